"""The pods of the stand-in Kubernetes API server (tests/support/fakes/apiserver.py): what
the cluster holds and how a change reaches a watch, without the HTTP.

- Pods in any namespaces, one resourceVersion counter bumped by every change, and a
  bounded history of the changes (HISTORY) for watches from an older version.
- The event a watch sees of a change: ADDED, MODIFIED or DELETED with the whole Pod; a Pod
  whose labels stop or start matching the watch's selector is DELETED or ADDED, as the
  real server does. Equality-based label selectors only (`a=b,c!=d,e,!f`).
- The test's hand on the pods (`add_pod`, `set_phase`, `set_ready`, `set_labels`,
  `set_annotations`, `mark_terminating`, `delete_pod`) and on the open watches
  (`expire_watches`, `end_watches`, `break_watches`, `bookmark`).
"""

from __future__ import annotations

import asyncio
import copy
import itertools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

Obj = dict[str, Any]

HISTORY = 10_000  # changes kept for watches from an older version
TIMESTAMP = "2025-01-01T00:00:00Z"


class BadRequest(Exception):
    """A request the stand-in refuses with 400 (or does not model)."""


def selector_terms(text: str) -> list[tuple[str, str, str | None]]:
    """`a=b,c!=d,e,!f` as (key, op, value) terms; set-based terms are not modelled."""
    terms: list[tuple[str, str, str | None]] = []
    for raw in filter(None, (t.strip() for t in text.split(","))):
        if " in " in raw or " notin " in raw or "(" in raw:
            raise BadRequest(f"set-based selector {raw!r} is not modelled")
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in raw:
            key, value = raw.replace("==", "=").split("=", 1)
            terms.append((key.strip(), "=", value.strip()))
        elif raw.startswith("!"):
            terms.append((raw[1:].strip(), "!", None))
        else:
            terms.append((raw, "exists", None))
    return terms


def matches(terms: list[tuple[str, str, str | None]], pod: Obj) -> bool:
    labels: Mapping[str, Any] = pod["metadata"].get("labels") or {}
    for key, op, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!" and key in labels:
            return False
    return True


@dataclass(eq=False)
class Watch:
    namespace: str
    terms: list[tuple[str, str, str | None]]
    bookmarks: bool
    writer: asyncio.StreamWriter
    queue: asyncio.Queue[tuple[str, Any]] = field(default_factory=asyncio.Queue)


@dataclass(frozen=True)
class Change:
    version: int
    namespace: str
    old: Obj | None  # None: created
    new: Obj  # the pod after (for a deletion: its last state, with the new version)
    deleted: bool = False


class Pods:
    """The pods, their history and the open watches; the server serves them."""

    def __init__(self, gone_status: bool = False) -> None:
        self.gone_status = gone_status  # a too-old watch: HTTP 410, else an ERROR event
        self.version = 1
        self._pods: dict[tuple[str, str], Obj] = {}
        self._history: list[Change] = []
        self._compacted = 0  # a watch from before this version: 410 Gone
        self._watching: set[Watch] = set()
        self._uids = itertools.count(1)

    @property
    def open_watches(self) -> int:
        return len(self._watching)

    # -- the test's hand on the pods ------------------------------------------------------

    def add_pod(
        self,
        namespace: str,
        name: str,
        labels: Mapping[str, str] | None = None,
        annotations: Mapping[str, str] | None = None,
        ip: str | None = None,
        ports: Mapping[str, int] | None = None,
        phase: str = "Pending",
        ready: bool = False,
    ) -> None:
        """A new pod (Pending, no IP, not Ready unless said); `ports`: its one
        container's ports by name."""
        key = (namespace, name)
        assert key not in self._pods, f"pod {namespace}/{name} exists"
        pod: Obj = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "uid": f"00000000-0000-0000-0000-{next(self._uids):012d}",
                "creationTimestamp": TIMESTAMP,
                "labels": dict(labels or {}),
                "annotations": dict(annotations or {}),
            },
            "spec": {
                "containers": [
                    {
                        "name": "worker",
                        "image": "worker:test",
                        "ports": [
                            {"name": n, "containerPort": p, "protocol": "TCP"}
                            for n, p in (ports or {}).items()
                        ],
                    }
                ]
            },
            "status": {"phase": phase, "conditions": []},
        }
        self._set_ip(pod, ip)
        self._set_ready(pod, ready)
        self._change(namespace, None, pod)

    def set_phase(self, namespace: str, name: str, phase: str, ip: str | None = None) -> None:
        """The pod's phase (and its IP, if given: a pod gets one as it starts)."""
        pod = self._edit(namespace, name)
        pod["status"]["phase"] = phase
        if ip is not None:
            self._set_ip(pod, ip)
        self._commit(namespace, name, pod)

    def set_ready(self, namespace: str, name: str, ready: bool) -> None:
        pod = self._edit(namespace, name)
        self._set_ready(pod, ready)
        self._commit(namespace, name, pod)

    def set_labels(self, namespace: str, name: str, labels: Mapping[str, str]) -> None:
        pod = self._edit(namespace, name)
        pod["metadata"]["labels"] = dict(labels)
        self._commit(namespace, name, pod)

    def set_annotations(self, namespace: str, name: str, annotations: Mapping[str, str]) -> None:
        pod = self._edit(namespace, name)
        pod["metadata"]["annotations"] = dict(annotations)
        self._commit(namespace, name, pod)

    def mark_terminating(self, namespace: str, name: str) -> None:
        """A delete asked for: deletionTimestamp set, the pod still there (and, as the
        kubelet would soon, no longer Ready)."""
        pod = self._edit(namespace, name)
        pod["metadata"]["deletionTimestamp"] = TIMESTAMP
        pod["metadata"]["deletionGracePeriodSeconds"] = 30
        self._commit(namespace, name, pod)

    def delete_pod(self, namespace: str, name: str) -> None:
        old = self._pods.pop((namespace, name))
        self.version += 1
        last = copy.deepcopy(old)
        last["metadata"]["resourceVersion"] = str(self.version)
        self._record(Change(self.version, namespace, old, last, deleted=True))

    def pod(self, namespace: str, name: str) -> Obj:
        return copy.deepcopy(self._pods[(namespace, name)])

    # -- the test's hand on the watches ---------------------------------------------------

    def expire_watches(self, as_status: bool | None = None) -> None:
        """The history is gone (compacted): the open watches get an ERROR event with 410
        (or, `as_status`, just end, so that a client watching again from where it was
        gets an HTTP 410); every watch from an older version gets 410 from now on."""
        if as_status is not None:
            self.gone_status = as_status
        self._history.clear()
        self.version += 1  # every version handed out so far is older than the history
        self._compacted = self.version
        for watch in self._watching:
            watch.queue.put_nowait(("end" if self.gone_status else "expire", None))

    def end_watches(self) -> None:
        """The open watches end cleanly (as at their timeoutSeconds)."""
        for watch in self._watching:
            watch.queue.put_nowait(("end", None))

    def break_watches(self) -> None:
        """The open watches' connections cut mid-stream (no end of the chunked body)."""
        for watch in list(self._watching):
            watch.writer.transport.abort()

    def bookmark(self) -> None:
        """A BOOKMARK (the version now) to the watches that allowed them."""
        for watch in self._watching:
            if watch.bookmarks:
                watch.queue.put_nowait(("bookmark", self.version))

    # -- changes --------------------------------------------------------------------------

    def _edit(self, namespace: str, name: str) -> Obj:
        return copy.deepcopy(self._pods[(namespace, name)])

    def _commit(self, namespace: str, name: str, pod: Obj) -> None:
        self._change(namespace, self._pods[(namespace, name)], pod)

    @staticmethod
    def _set_ip(pod: Obj, ip: str | None) -> None:
        if ip is not None:
            pod["status"]["podIP"] = ip
            pod["status"]["podIPs"] = [{"ip": ip}]

    @staticmethod
    def _set_ready(pod: Obj, ready: bool) -> None:
        conditions = [c for c in pod["status"]["conditions"] if c["type"] != "Ready"]
        conditions.append(
            {
                "type": "Ready",
                "status": "True" if ready else "False",
                "lastTransitionTime": TIMESTAMP,
            }
        )
        pod["status"]["conditions"] = conditions

    def _change(self, namespace: str, old: Obj | None, new: Obj) -> None:
        self.version += 1
        new["metadata"]["resourceVersion"] = str(self.version)
        self._pods[(namespace, new["metadata"]["name"])] = new
        self._record(Change(self.version, namespace, old, new))

    def _record(self, change: Change) -> None:
        self._history.append(change)
        if len(self._history) > HISTORY:
            dropped = self._history.pop(0)
            self._compacted = dropped.version
        for watch in self._watching:
            if watch.namespace == change.namespace:
                watch.queue.put_nowait(("change", change))

    @staticmethod
    def _event(watch: Watch, change: Change) -> Obj | None:
        """The event this watch sees of a change (None: none, the pod is not its)."""
        was = change.old is not None and matches(watch.terms, change.old)
        now = not change.deleted and matches(watch.terms, change.new)
        if change.deleted:
            return {"type": "DELETED", "object": change.new} if was else None
        if was and now:
            return {"type": "MODIFIED", "object": change.new}
        if now:
            return {"type": "ADDED", "object": change.new}
        if was:
            return {"type": "DELETED", "object": change.new}
        return None
