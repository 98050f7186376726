"""Kubernetes discovery: the Pods a label selector matches in one namespace, listed, then
watched from the list's resourceVersion; each Pod with an IP and the configured container
port is a host, in service while Running, Ready and not terminating.

The client is lightkube: small, typed models, async list and watch with resourceVersion,
and both kubeconfig and in-cluster (service account) credentials.

After the list, and after each batch of watch events that changes a host, the whole set
is reported. A watch that expires (410 Gone, as an HTTP status or as an ERROR event) or
breaks is followed by a new list, and the set reported before stands until that list is
reported: no host leaves in between. A watch the server ends cleanly (its timeout) is
resumed by lightkube from the last version seen, with no list. The list is made again
every `resync_s` whatever the watch says. A failed list or watch keeps the last set, is
logged once per outage and counted, and is tried again after 1 s, then 2, 4 ... 30 s.

A Pod says what it likes (labels, annotations, ports): what is kept of it is bounded
(MAX_PODS pods, a host per pod, names validated by WorkerSpec), and a Pod that does not
make a valid host is skipped and logged once per problem. A set of more than `max_hosts`
hosts is not reported (refused, counted and logged as a failure): the last set stands.
"""

from __future__ import annotations

import asyncio
import ipaddress
import math
import time

import httpx2
import msgspec
import pydantic
import structlog
from lightkube import AsyncClient, KubeConfig
from lightkube.core.client import LabelSelector
from lightkube.core.exceptions import ApiError, NotReadyError
from lightkube.core.exceptions import ConfigError as KubeConfigError
from lightkube.resources.core_v1 import Pod

from gateway.config import KubernetesDiscovery, WorkerSpec
from gateway.core.tasks import TaskScope
from gateway.discovery.source import Discovered, Report, SourceStats, publish

log = structlog.get_logger("gateway.discovery")

MAX_PODS = 10_000  # pods one source keeps; more are ignored (logged once)
MAX_POD_NAME = 253  # Kubernetes' own bound on an object name
LIST_PAGE = 500  # pods per list response: the client holds one page at a time
BACKOFF_MIN_S = 1.0
BACKOFF_MAX_S = 30.0
MIN_RELIST_S = 1.0  # lists at most this often, whatever makes the watch end
WATCH_SLACK_S = 10  # the server ends a watch this long after we would have left it

# What a list or watch can fail with that is the cluster's doing, not a bug here.
FAILURES = (httpx2.HTTPError, msgspec.MsgspecError, NotReadyError, KubeConfigError, OSError)


class KubeError(Exception):
    """This list or watch said nothing usable: the last hosts stay."""


class PodProblem(ValueError):
    """Why a Pod is no host (its message is the whole story)."""


class KubernetesSource:
    def __init__(self, config: KubernetesDiscovery) -> None:
        self.config = config
        self.stats = SourceStats(config.label)
        self.namespace = config.namespace or ""  # the client's default once connected
        # The selector as given, whatever its syntax: lightkube writes a key whose value
        # is None ("exists") as the bare key.
        self._labels: LabelSelector | None = {config.selector: None} if config.selector else None
        self._pods: dict[str, Discovered | None] = {}  # pod name -> its host, None: not one
        self._problems: dict[str, str] = {}  # pod name -> why it is skipped (logged)
        self._over_limit = False
        self._last_list = -math.inf

    # -- the loop -------------------------------------------------------------------------

    async def run(self, report: Report) -> None:
        backoff = BACKOFF_MIN_S
        client: AsyncClient | None = None
        try:
            while True:
                try:
                    if client is None:
                        client = self._connect()
                    await self._pace()
                    version = await self._list(client)
                    self._report(report)
                    why = await self._watch(client, version, report)
                    log.debug("kubernetes_relist", source=self.stats.name, why=why)
                    backoff = BACKOFF_MIN_S
                except KubeError as exc:
                    self.stats.failed(str(exc))
                    await asyncio.sleep(backoff)
                    backoff = min(2 * backoff, BACKOFF_MAX_S)
        finally:
            if client is not None:
                await client.close()

    def _connect(self) -> AsyncClient:
        """A client with the configured kubeconfig, else in-cluster credentials, else
        $KUBECONFIG or ~/.kube/config (lightkube's order)."""
        path = self.config.kubeconfig
        try:
            kubeconfig = KubeConfig.from_file(path) if path else KubeConfig.from_env()
            client = AsyncClient(kubeconfig, namespace=self.config.namespace)
        except Exception as exc:  # a kubeconfig fails in many ways (file, YAML, keys, URL)
            raise KubeError(f"kubernetes credentials: {_describe(exc)}") from None
        self.namespace = client.namespace
        return client

    async def _pace(self) -> None:
        """A watch that ends at once, again and again, must not make lists a busy loop."""
        wait = self._last_list + MIN_RELIST_S - time.monotonic()
        if wait > 0:
            await asyncio.sleep(wait)

    def _report(self, report: Report) -> None:
        hosts = sorted((h for h in self._pods.values() if h is not None), key=lambda h: h.origin)
        publish(report, self.stats, hosts, self.config.max_hosts)

    # -- list and watch -------------------------------------------------------------------

    async def _list(self, client: AsyncClient) -> str:
        """Every matching Pod now (taking the place of what was known); the list's
        resourceVersion, to watch from."""
        self._last_list = time.monotonic()
        pods: dict[str, Discovered | None] = {}
        problems, self._problems = self._problems, {}
        over = 0
        try:
            listing = client.list(
                Pod, namespace=self.namespace, labels=self._labels, chunk_size=LIST_PAGE
            )
            async for pod in listing:
                name = _name(pod)
                if name is None:
                    continue
                if len(pods) >= MAX_PODS and name not in pods:
                    over += 1
                    continue
                pods[name] = self._host(name, pod, problems.get(name))
            version = listing.resourceVersion
        except FAILURES as exc:
            self._problems = problems
            raise KubeError(f"list pods in {self.namespace}: {_describe(exc)}") from None
        self._pods = pods
        self._limit(over > 0)
        return version

    async def _watch(self, client: AsyncClient, version: str, report: Report) -> str:
        """Apply the changes since `version`, reporting after each batch, until a new
        list is due; why it is (expired, broken, resync). A watch that fails otherwise
        raises KubeError."""
        changed = asyncio.Event()

        async def follow() -> None:
            events = client.watch(
                Pod,
                namespace=self.namespace,
                labels=self._labels,
                resource_version=version,
                server_timeout=math.ceil(self.config.resync_s) + WATCH_SLACK_S,
            )
            async for kind, pod in events:
                if self._apply(kind, pod):
                    changed.set()

        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.config.resync_s
        async with TaskScope(log_failures=False) as scope:  # the reader's error: `_ended`
            reader = scope.spawn(follow(), "kubernetes_watch", namespace=self.namespace)
            while True:
                waiter = scope.spawn(changed.wait(), "kubernetes_watch_change")
                await asyncio.wait(
                    (reader, waiter),
                    timeout=max(0.0, deadline - loop.time()),
                    return_when=asyncio.FIRST_COMPLETED,
                )
                waiter.cancel()
                if changed.is_set():  # every event that came with it is applied too
                    changed.clear()
                    self._report(report)
                if reader.done():
                    return self._ended(reader)
                if loop.time() >= deadline:
                    return "resync"

    def _ended(self, reader: asyncio.Task[None]) -> str:
        """Why the watch ended: a new list mends it, or KubeError if it failed."""
        exc = reader.exception()
        if exc is None:  # lightkube watches again by itself when a watch ends cleanly
            return "ended"
        if isinstance(exc, ApiError) and exc.status.code == 410:
            return "expired"  # an ERROR event: the version is too old
        if isinstance(exc, httpx2.HTTPStatusError) and exc.response.status_code == 410:
            return "expired"
        if isinstance(exc, httpx2.TransportError):
            return f"broken ({_describe(exc)})"
        if isinstance(exc, FAILURES):
            raise KubeError(f"watch pods in {self.namespace}: {_describe(exc)}")
        raise exc  # a bug: the runner logs it and starts the source again

    def _apply(self, kind: str, pod: Pod) -> bool:
        """One watch event; whether it changed a host (a report is due). Most of a Pod's
        updates (container statuses, probe times) change none."""
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return False  # BOOKMARK: only a newer version to watch from
        name = _name(pod)
        if name is None:
            return False
        if kind == "DELETED":
            self._problems.pop(name, None)
            return self._pods.pop(name, None) is not None
        if name not in self._pods and len(self._pods) >= MAX_PODS:
            self._limit(True)
            return False
        before = self._pods.get(name)
        self._pods[name] = host = self._host(name, pod, self._problems.pop(name, None))
        return host != before

    def _limit(self, over: bool) -> None:
        if over and not self._over_limit:
            log.warning("kubernetes_too_many_pods", source=self.stats.name, kept=MAX_PODS)
        self._over_limit = over

    # -- one pod --------------------------------------------------------------------------

    def _host(self, name: str, pod: Pod, logged: str | None) -> Discovered | None:
        """The host a Pod is, or None (terminating, no IP yet, or skipped: a problem,
        logged unless `logged` says it was already)."""
        meta, status = pod.metadata, pod.status
        if meta is None or meta.deletionTimestamp is not None:
            return None  # terminating: no new calls; not listed, so it is drained at once
        if status is None or not status.podIP:
            return None  # not scheduled or not started yet
        try:
            spec = self._spec(pod, status.podIP)
        except ValueError as exc:  # PodProblem, and WorkerSpec's ValidationError
            problem = _describe(exc)
            self._problems[name] = problem
            if problem != logged:
                log.warning(
                    "kubernetes_pod_skipped",
                    source=self.stats.name,
                    pod=f"{self.namespace}/{name}",
                    problem=problem,
                )
            return None
        ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or ())
        in_service = status.phase == "Running" and ready
        return Discovered(spec, f"kubernetes:{self.namespace}/{name}", in_service)

    def _spec(self, pod: Pod, ip: str) -> WorkerSpec:
        """The worker a Pod with an IP is; ValueError says why it is none."""
        c = self.config
        meta = pod.metadata
        assert meta is not None
        try:
            host = str(ipaddress.ip_address(ip))
        except ValueError:
            raise PodProblem(f"pod IP {ip[:64]!r} is not an address") from None
        model = c.model
        if c.model_from is not None:
            kind, _, key = c.model_from.partition(":")
            model = _text((meta.labels if kind == "label" else meta.annotations) or {}, key)
            if model is None:
                raise PodProblem(f"no {kind} {key}")
        bootstrap = None
        if c.bootstrap_port_annotation is not None:
            key = c.bootstrap_port_annotation
            value = _text(meta.annotations or {}, key)
            if value is not None:
                bootstrap = _port_number(value)
                if bootstrap is None:
                    raise PodProblem(f"annotation {key} {value[:32]!r} is not a port number")
        return WorkerSpec(
            host=host,
            port=self._container_port(pod),
            model=model,
            runtime=c.runtime,
            role=c.role,
            tls=c.tls,
            bootstrap_port=bootstrap,
        )

    def _container_port(self, pod: Pod) -> int:
        port = self.config.port
        if isinstance(port, int):
            return port
        number = _port_number(port)  # "8000" can only be a number: names have a letter
        if number is not None:
            return number
        for container in pod.spec.containers if pod.spec is not None else ():
            for declared in container.ports or ():
                if declared.name == port and isinstance(declared.containerPort, int):
                    return declared.containerPort
        raise PodProblem(f"no container port named {port!r}")


def _name(pod: Pod) -> str | None:
    name = pod.metadata.name if pod.metadata is not None else None
    return name if isinstance(name, str) and 0 < len(name) <= MAX_POD_NAME else None


def _text(values: dict[str, object], key: str) -> str | None:
    """A label's or annotation's value, if it is text (a Pod's JSON can hold anything)."""
    value = values.get(key)
    return value if isinstance(value, str) else None


def _port_number(text: str) -> int | None:
    if not (text.isascii() and text.isdigit() and len(text) <= 5):
        return None
    number = int(text)
    return number if 1 <= number <= 65535 else None


def _describe(exc: BaseException) -> str:
    """One line: the error's own words (pydantic's first problem), its kind if none."""
    if isinstance(exc, PodProblem):
        return str(exc)
    if isinstance(exc, pydantic.ValidationError):
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        return f"{where}: {first['msg']}" if where else first["msg"]
    if isinstance(exc, ApiError):
        return f"{exc.status.code} {exc.status.reason or ''} {exc.status.message or ''}".strip()
    if isinstance(exc, httpx2.HTTPStatusError):
        return f"{exc.response.status_code} {exc.response.reason_phrase}"
    text = " ".join(str(exc).split())[:300]
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
