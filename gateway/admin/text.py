"""How the admin CLI shows what the admin API answered: the workers' table, event lines,
queues and routes as text, or each message as a JSON line (--json)."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Sequence
from typing import Any

from google.protobuf.json_format import MessageToDict
from google.protobuf.message import Message

from gateway.admin.v1 import admin_pb2 as pb


def format_queues(listed: pb.ListQueuesResponse) -> str:
    if not listed.enabled:
        return "flow control is off (no flow: section): calls are refused, never queued"
    if not listed.queues:
        return "no calls waiting"
    rows = [["MODEL", "CLASS", "TENANT", "WAITING"]]
    rows += [[q.model, q.priority, q.tenant, str(q.waiting)] for q in listed.queues]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(
        "  ".join([*(cell.ljust(w) for cell, w in zip(row, widths, strict=False)), row[3]])
        for row in rows
    )


def split_text(route: pb.Route) -> str:
    return " ".join(f"{t.model}={t.weight}" for t in route.targets)


def format_routes(routes: Sequence[pb.Route]) -> str:
    """One alias a line: `chat  llama-3-8b-v2=90 llama-3-8b-v3=10`."""
    if not routes:
        return "no model aliases (a models: entry with route makes one)"
    rows = [("ALIAS", "TARGETS"), *((r.alias, split_text(r)) for r in routes)]
    width = max(len(alias) for alias, _ in rows)
    return "\n".join(f"{alias.ljust(width)}  {split}" for alias, split in rows)


def as_dict(message: Message) -> dict[str, Any]:
    return MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def show(message: Message, as_json: bool, text: str) -> None:
    print(json.dumps(as_dict(message)) if as_json else text, flush=True)


def enum_name(enum: Any, value: int, prefix: str) -> str:
    """`WORKER_STATUS_NOT_READY` -> `not_ready`, as in the gateway's logs and config."""
    try:
        return str(enum.Name(value)).removeprefix(prefix).lower()
    except ValueError:
        return str(value)


def status_name(value: int) -> str:
    return enum_name(pb.WorkerStatus, value, "WORKER_STATUS_")


def outlier_name(value: int) -> str:
    """Outlier detection's state (the API's BreakerState): closed, half_open or open."""
    return enum_name(pb.BreakerState, value, "BREAKER_STATE_")


def role_name(value: int) -> str:
    return enum_name(pb.Role, value, "ROLE_")


def summary(worker: pb.Worker) -> str:
    return (
        f"{worker.id} (model {worker.model}, runtime {worker.runtime}, "
        f"role {role_name(worker.role)}): {status_name(worker.status)}"
    )


def ago(stamp: Any, now: float) -> str:
    seconds = max(0.0, now - stamp.ToNanoseconds() / 1e9)
    return f"{seconds:.1f}s ago" if seconds < 60 else f"{seconds / 60:.0f}m ago"


COLUMNS = (
    "WORKER",
    "MODEL",
    "RUNTIME",
    "ROLE",
    "SOURCE",
    "STATUS",
    "INFLIGHT",
    "OUTLIER",
    "RUN",
    "WAIT",
    "KV",
    "LORA",
    "LAST PROBE",
    "CAUSE",
)


def row(worker: pb.Worker, now: float) -> list[str]:
    probe = "-"
    if worker.HasField("last_probe"):
        probe = enum_name(pb.ProbeKind, worker.last_probe.kind, "PROBE_KIND_")
        if worker.last_probe.HasField("time"):
            probe += f" {ago(worker.last_probe.time, now)}"
    run = wait = kv = "-"
    if worker.HasField("load"):
        load = worker.load
        run, wait, kv = str(load.running), str(load.waiting), f"{load.token_usage:.0%}"
    cause = worker.status_cause
    if worker.load_error:
        cause = f"{cause}; load: {worker.load_error}" if cause else f"load: {worker.load_error}"
    return [  # what an unidentified worker's URL leaves open: "?"
        worker.id,
        worker.model or "?",
        worker.runtime or "?",
        role_name(worker.role) if worker.role else "?",
        ",".join(worker.sources) or "-",
        status_name(worker.status),
        str(worker.inflight),
        outlier_name(worker.breaker_state),
        run,
        wait,
        kv,
        shown_adapters(worker.lora_adapters),
        probe,
        cause,
    ]


MAX_SHOWN_ADAPTERS = 3  # a table row names this many adapters, then counts the rest


def shown_adapters(adapters: Sequence[str]) -> str:
    """The LoRA adapters a worker holds, as a table cell: a few, then how many more."""
    if not adapters:
        return "-"
    more = len(adapters) - MAX_SHOWN_ADAPTERS
    return ",".join(adapters[:MAX_SHOWN_ADAPTERS]) + (f",+{more}" if more > 0 else "")


def format_table(workers: Sequence[pb.Worker], now: float | None = None) -> str:
    """Aligned columns, one worker a line; the last column (the cause) is not padded."""
    stamp = time.time() if now is None else now
    rows = [list(COLUMNS), *(row(w, stamp) for w in workers)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS) - 1)]
    return "\n".join(
        "  ".join([*(cell.ljust(width) for cell, width in zip(row, widths, strict=False)), row[-1]])
        for row in rows
    )


def show_workers(workers: Sequence[pb.Worker], as_json: bool) -> None:
    if as_json:
        for worker in workers:
            print(json.dumps(as_dict(worker)))
    elif not workers:
        print("no workers registered")
    else:
        print(format_table(workers))
    sys.stdout.flush()


def event_line(event: pb.WatchWorkersResponse) -> str:
    kind = enum_name(pb.WorkerEventKind, event.kind, "WORKER_EVENT_KIND_")
    worker = event.worker
    stamp = time.strftime("%H:%M:%S", time.localtime(event.time.seconds))
    which = event.WhichOneof("change")
    if which == "status_change":
        change = event.status_change
        what = f"{status_name(change.old_status)} -> {status_name(change.new_status)}"
    elif which == "breaker_change":
        outlier = event.breaker_change
        what = f"outlier {outlier_name(outlier.old_state)} -> {outlier_name(outlier.new_state)}"
    else:
        what = f"{worker.model} {worker.runtime} {role_name(worker.role)} " + status_name(
            worker.status
        )
    cause = f": {event.cause}" if event.cause else ""
    return f"{stamp} {kind:<8} {worker.id} {what}{cause}"
