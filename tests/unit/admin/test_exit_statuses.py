"""The admin CLI's exit statuses: one per kind of failure a script may act on, mapped
from the gRPC codes the admin service answers with, told in one table (`--help` and the
module's docstring)."""

from __future__ import annotations

import grpc

import gateway.admin.client as client
from gateway.admin.client import EXIT_STATUSES, exit_status, exit_status_help


def test_each_code_the_admin_service_answers_with_has_its_own_status() -> None:
    assert exit_status(grpc.StatusCode.INVALID_ARGUMENT) == 2
    assert exit_status(grpc.StatusCode.NOT_FOUND) == 3
    assert exit_status(grpc.StatusCode.ALREADY_EXISTS) == 4
    assert exit_status(grpc.StatusCode.UNAVAILABLE) == 5
    assert exit_status(grpc.StatusCode.DEADLINE_EXCEEDED) == 5
    assert exit_status(grpc.StatusCode.UNAUTHENTICATED) == 6
    assert exit_status(grpc.StatusCode.PERMISSION_DENIED) == 6
    assert exit_status(grpc.StatusCode.FAILED_PRECONDITION) == 7
    for other in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNIMPLEMENTED):
        assert exit_status(other) == 1


def test_no_code_is_mapped_twice_and_the_statuses_are_in_order() -> None:
    codes = [code for _, _, listed in EXIT_STATUSES for code in listed]
    assert len(codes) == len(set(codes))
    statuses = [status for status, _, _ in EXIT_STATUSES]
    assert statuses == sorted(set(statuses))


def test_the_module_docstring_carries_the_help_table() -> None:
    table = exit_status_help()
    assert table.startswith("exit status:\n  0    done\n")
    assert table in (client.__doc__ or "")
    assert all(len(line) <= 88 for line in table.splitlines())
