"""`gateway workers list|add|remove|drain|watch`, `gateway queues` and `gateway models
routes|set-route`: the admin API from the command line.

Talks to a running gateway's admin port with the generated stub; prints a table (or JSON
lines with --json), and on an RPC error prints `gateway: <CODE>: <details>` and exits
with a status that tells the cases apart (`EXIT_STATUSES`, in `--help` too):

exit status:
  0    done
  1    any other error (its gRPC code and message on stderr)
  2    usage error, or a value the gateway refused (INVALID_ARGUMENT: a bad worker URL,
       a negative duration, a route the config's rules refuse)
  3    no such worker, or no such model alias (NOT_FOUND)
  4    that worker is already registered (ALREADY_EXISTS)
  5    unreachable: the admin port did not answer (connection refused, no answer in
       time), or, for add, the worker did not tell its model and runtime in time
       (UNAVAILABLE, DEADLINE_EXCEEDED): trying again later may work
  6    the admin token is missing or was not accepted (UNAUTHENTICATED,
       PERMISSION_DENIED)
  7    not in the worker's state (FAILED_PRECONDITION: removing a worker a discovery
       source lists, drain it or remove it from the source; resuming a worker being
       removed)
  130  interrupted (Ctrl-C)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

from google.protobuf.duration_pb2 import Duration
from grpc import StatusCode, aio

from gateway.admin.text import (
    as_dict,
    event_line,
    format_queues,
    format_routes,
    show,
    show_workers,
    split_text,
    summary,
)
from gateway.admin.v1 import admin_pb2 as pb
from gateway.admin.v1 import admin_pb2_grpc

DEFAULT_ADMIN = "127.0.0.1:50052"
TOKEN_ENV = "GATEWAY_ADMIN_TOKEN"
CALL_TIMEOUT_S = 30.0  # for calls that do not wait on purpose (list, add, drain)

# (exit status, what it means, the gRPC codes that end in it), the table of `--help` and
# of this module's docstring. A code not listed exits 1; a usage error exits 2 (argparse).
EXIT_STATUSES: tuple[tuple[int, str, tuple[StatusCode, ...]], ...] = (
    (0, "done", ()),
    (1, "any other error (its gRPC code and message on stderr)", ()),
    (
        2,
        "usage error, or a value the gateway refused (INVALID_ARGUMENT: a bad worker URL,"
        " a negative duration, a route the config's rules refuse)",
        (StatusCode.INVALID_ARGUMENT,),
    ),
    (3, "no such worker, or no such model alias (NOT_FOUND)", (StatusCode.NOT_FOUND,)),
    (4, "that worker is already registered (ALREADY_EXISTS)", (StatusCode.ALREADY_EXISTS,)),
    (
        5,
        "unreachable: the admin port did not answer (connection refused, no answer in time),"
        " or, for add, the worker did not tell its model and runtime in time (UNAVAILABLE,"
        " DEADLINE_EXCEEDED): trying again later may work",
        (StatusCode.UNAVAILABLE, StatusCode.DEADLINE_EXCEEDED),
    ),
    (
        6,
        "the admin token is missing or was not accepted (UNAUTHENTICATED, PERMISSION_DENIED)",
        (StatusCode.UNAUTHENTICATED, StatusCode.PERMISSION_DENIED),
    ),
    (
        7,
        "not in the worker's state (FAILED_PRECONDITION: removing a worker a discovery"
        " source lists, drain it or remove it from the source; resuming a worker being"
        " removed)",
        (StatusCode.FAILED_PRECONDITION,),
    ),
    (130, "interrupted (Ctrl-C)", ()),
)
EXIT_FOR_CODE = {code: status for status, _, codes in EXIT_STATUSES for code in codes}
OTHER_ERROR = 1
INTERRUPTED = 130


def exit_status(code: StatusCode) -> int:
    """The exit status of a call that ended with gRPC status `code`."""
    return EXIT_FOR_CODE.get(code, OTHER_ERROR)


def exit_status_help(width: int = 88) -> str:
    """The exit status table, as `--help` and the module's docstring show it."""
    lines = ["exit status:"]
    for status, meaning, _ in EXIT_STATUSES:
        wrapped = textwrap.wrap(meaning, width - 7)
        lines.append(f"  {status:<4} {wrapped[0]}")
        lines += [f"       {more}" for more in wrapped[1:]]
    return "\n".join(lines) + "\n"


def _with_exit_statuses(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.epilog = exit_status_help()
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    return parser


def _add_common(common: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """--admin, --token, --json: what every admin command takes."""
    common.add_argument(
        "--admin",
        metavar="HOST:PORT",
        default=DEFAULT_ADMIN,
        help=f"the gateway's admin address (default {DEFAULT_ADMIN})",
    )
    common.add_argument("--token", metavar="T", help=f"admin bearer token (default: ${TOKEN_ENV})")
    common.add_argument("--json", action="store_true", help="print JSON lines")
    return common


def add_queues_arguments(parser: argparse.ArgumentParser) -> None:
    """The CLI's `queues` command: what waits, by model, class and tenant."""
    _add_common(_with_exit_statuses(parser))


def run_queues(args: argparse.Namespace) -> int:
    """0 on success, else the error's exit status (`EXIT_STATUSES`), told on stderr."""
    return _guarded(_queues(args))


async def _queues(args: argparse.Namespace) -> int:
    async with aio.insecure_channel(args.admin) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        listed = await stub.ListQueues(
            pb.ListQueuesRequest(), metadata=_auth(args), timeout=CALL_TIMEOUT_S
        )
    if args.json:
        print(json.dumps(as_dict(listed)))
    else:
        print(format_queues(listed))
    sys.stdout.flush()
    return 0


def route_target(text: str) -> pb.RouteTarget:
    """`MODEL=WEIGHT` (a whole number) as a route target; else a usage error."""
    model, equals, weight = text.rpartition("=")
    if not equals or not model or not weight.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not MODEL=WEIGHT (a whole number)")
    return pb.RouteTarget(model=model, weight=int(weight))


def add_models_arguments(parser: argparse.ArgumentParser) -> None:
    """The CLI's `models` command: the model aliases' routes, and changing one."""
    common = _add_common(argparse.ArgumentParser(add_help=False))
    _with_exit_statuses(parser)
    verbs = parser.add_subparsers(dest="models_command", metavar="VERB", required=True)
    _with_exit_statuses(
        verbs.add_parser("routes", parents=[common], help="list every model alias and its split")
    )
    set_route = _with_exit_statuses(
        verbs.add_parser(
            "set-route", parents=[common], help="replace an alias's targets and weights"
        )
    )
    set_route.add_argument("alias", metavar="ALIAS", help="the alias (a models: key with route)")
    set_route.add_argument(
        "targets",
        metavar="MODEL=WEIGHT",
        nargs="+",
        type=route_target,
        help="each target and its weight (whole numbers; at least one above 0)",
    )


def run_models(args: argparse.Namespace) -> int:
    """0 on success, else the error's exit status (`EXIT_STATUSES`), told on stderr."""
    return _guarded(_models(args))


async def _models(args: argparse.Namespace) -> int:
    metadata = _auth(args)
    async with aio.insecure_channel(args.admin) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        if args.models_command == "routes":
            listed = await stub.ListRoutes(
                pb.ListRoutesRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S
            )
            if args.json:
                for route in listed.routes:
                    print(json.dumps(as_dict(route)))
            else:
                print(format_routes(listed.routes))
        else:
            request = pb.SetRouteRequest(alias=args.alias, targets=args.targets)
            answer = await stub.SetRoute(request, metadata=metadata, timeout=CALL_TIMEOUT_S)
            show(answer, args.json, f"{answer.route.alias} -> {split_text(answer.route)}")
    sys.stdout.flush()
    return 0


def _auth(args: argparse.Namespace) -> tuple[tuple[str, str], ...] | None:
    token = args.token or os.environ.get(TOKEN_ENV)
    return (("authorization", f"Bearer {token}"),) if token else None


def _guarded(work: Any) -> int:
    try:
        return int(asyncio.run(work))
    except aio.AioRpcError as error:
        print(f"gateway: {error.code().name}: {error.details()}", file=sys.stderr)
        return exit_status(error.code())
    except KeyboardInterrupt:
        return INTERRUPTED


def add_workers_arguments(parser: argparse.ArgumentParser) -> None:
    """Mount the verbs on `parser` (the CLI's `workers` sub-command)."""
    common = _add_common(argparse.ArgumentParser(add_help=False))
    _with_exit_statuses(parser)
    verbs = parser.add_subparsers(dest="workers_command", metavar="VERB", required=True)

    def verb(name: str, text: str) -> argparse.ArgumentParser:
        return _with_exit_statuses(verbs.add_parser(name, parents=[common], help=text))

    verb("list", "list every worker and its state")
    add = verb("add", "register a worker")
    add.add_argument(
        "url", metavar="URL", help="grpc://HOST:PORT?model=M&runtime=sglang|vllm&role=R"
    )
    remove = verb("remove", "drain a worker, then forget it")
    remove.add_argument("worker_id", metavar="ID", help="worker id (HOST:PORT)")
    remove.add_argument(
        "--drain-timeout",
        type=float,
        metavar="S",
        help="seconds in-flight requests get to finish (default: the gateway's)",
    )
    drain = verb("drain", "stop new requests to a worker, keep it registered")
    drain.add_argument("worker_id", metavar="ID", help="worker id (HOST:PORT)")
    drain.add_argument(
        "--wait",
        type=float,
        default=0.0,
        metavar="S",
        help="wait up to S seconds for in-flight requests to finish (default 0)",
    )
    resume = verb("resume", "undo a drain: new requests to the worker again")
    resume.add_argument("worker_id", metavar="ID", help="worker id (HOST:PORT)")
    watch = verb("watch", "stream worker events")
    watch.add_argument(
        "--count", type=int, metavar="N", help="stop after N events (snapshot included)"
    )


def run_workers(args: argparse.Namespace) -> int:
    """Run one verb; 0 on success, else the error's exit status (`EXIT_STATUSES`), told
    on stderr."""
    return _guarded(_run(args))


def _duration(seconds: float) -> Duration:
    duration = Duration()
    duration.FromTimedelta(timedelta(seconds=seconds))
    return duration


async def _run(args: argparse.Namespace) -> int:
    metadata = _auth(args)
    async with aio.insecure_channel(args.admin) as channel:
        stub = admin_pb2_grpc.AdminServiceStub(channel)
        verb = args.workers_command
        if verb == "list":
            listed = await stub.ListWorkers(
                pb.ListWorkersRequest(), metadata=metadata, timeout=CALL_TIMEOUT_S
            )
            show_workers(listed.workers, args.json)
            if listed.sessions and not args.json:
                print(f"sessions bound (session affinity): {listed.sessions}")
        elif verb == "add":
            added = await stub.AddWorker(
                pb.AddWorkerRequest(url=args.url), metadata=metadata, timeout=CALL_TIMEOUT_S
            )
            show(added, args.json, f"added {summary(added.worker)}")
        elif verb == "remove":
            request = pb.RemoveWorkerRequest(worker_id=args.worker_id)
            timeout = None  # the gateway bounds the call by the drain timeout
            if args.drain_timeout is not None:
                request.drain_timeout.CopyFrom(_duration(args.drain_timeout))
                timeout = args.drain_timeout + CALL_TIMEOUT_S
            removed = await stub.RemoveWorker(request, metadata=metadata, timeout=timeout)
            left = removed.worker.inflight
            how = "drained" if removed.drained else f"{left} requests were still in flight"
            show(removed, args.json, f"removed {removed.worker.id} ({how})")
        elif verb == "drain":
            request_drain = pb.DrainWorkerRequest(worker_id=args.worker_id)
            if args.wait:
                request_drain.wait.CopyFrom(_duration(args.wait))
            drained = await stub.DrainWorker(
                request_drain, metadata=metadata, timeout=args.wait + CALL_TIMEOUT_S
            )
            left = drained.worker.inflight
            state = "idle" if drained.drained else f"{left} requests in flight"
            show(drained, args.json, f"draining {drained.worker.id} ({state})")
        elif verb == "resume":
            resumed = await stub.ResumeWorker(
                pb.ResumeWorkerRequest(worker_id=args.worker_id),
                metadata=metadata,
                timeout=CALL_TIMEOUT_S,
            )
            show(resumed, args.json, f"resumed {summary(resumed.worker)}")
        else:
            await _watch(stub, metadata, args.count, args.json)
    return 0


async def _watch(
    stub: admin_pb2_grpc.AdminServiceStub,
    metadata: Sequence[tuple[str, str]] | None,
    count: int | None,
    as_json: bool,
) -> None:
    if count is not None and count <= 0:
        return
    call = stub.WatchWorkers(pb.WatchWorkersRequest(), metadata=metadata)
    seen = 0
    try:
        async for event in call:
            show(event, as_json, event_line(event))
            seen += 1
            if count is not None and seen >= count:
                break
    finally:
        call.cancel()


__all__ = [
    "EXIT_STATUSES",
    "add_models_arguments",
    "add_queues_arguments",
    "add_workers_arguments",
    "exit_status",
    "exit_status_help",
    "run_models",
    "run_queues",
    "run_workers",
]


# The admin CLI's commands (`gateway workers|queues|models`): how each adds its arguments
# and runs, for the command line to dispatch to.
ADMIN_COMMANDS: dict[
    str,
    tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]],
] = {
    "workers": (add_workers_arguments, run_workers),
    "queues": (add_queues_arguments, run_queues),
    "models": (add_models_arguments, run_models),
}
