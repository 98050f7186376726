"""Helpers several tests share (no test imports another test module)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from gateway.cli.main import build_parser


def cli_policy_choices() -> tuple[str, ...]:
    serve = next(
        action
        for action in build_parser()._actions
        if isinstance(action, argparse._SubParsersAction)
    ).choices["serve"]
    policy = next(a for a in serve._actions if a.dest == "policy")
    return tuple(policy.choices or ())


@dataclass(frozen=True)
class C:
    id: str
    inflight: int = 0
