"""A stand-in Kubernetes API server: pods only, in any namespaces, over plain HTTP/1.1 on
127.0.0.1, speaking the list/watch protocol a client such as lightkube relies on.

- `GET /api/v1/namespaces/NS/pods?labelSelector=...` answers a PodList whose
  metadata.resourceVersion is the server's version now; `limit` and `continue` page it
  (a consistent snapshot, as the real server's).
- The same with `watch=true` streams chunked, newline-delimited watch events: from
  `resourceVersion=RV` every change after RV (ADDED, MODIFIED, DELETED with the whole
  Pod; a Pod whose labels stop or start matching the selector is DELETED or ADDED, as
  the real server does), without one the current pods as ADDED first; BOOKMARK events
  when `allowWatchBookmarks=true` and the test sends them; `timeoutSeconds` ends it.
  A watch from an RV older than the server's history gets an ERROR event with a 410
  Status (or, with `gone_status`, an HTTP 410 answer).
- One resourceVersion counter, bumped by every change.

The pods, their history and the events a watch sees of a change are Pods
(tests/support/fakes/pods.py); this module serves them over HTTP.

The test drives it: `add_pod`, `set_phase`, `set_ready`, `set_labels`, `set_annotations`,
`mark_terminating`, `delete_pod`, `expire_watches`, `end_watches`, `break_watches`,
`bookmark`, `stop`/`start` (the server down and back on its port), and reads `lists`,
`watches` (requests counted) and `open_watches`.

Not modelled: RBAC and every authentication but one optional bearer token; TLS; field
selectors and set-based label selectors (`in`, `notin`); resources other than pods,
writes through the API (create, patch, server-side apply, delete), subresources; HTTP/2
and protobuf; `resourceVersionMatch`, `sendInitialEvents`; history compaction but for
`expire_watches` (and a bound of HISTORY events); the kubelet (phases change only when the
test says).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import parse_qs, urlsplit

from tests.support.fakes.pods import BadRequest, Obj, Pods, Watch, matches, selector_terms

T = TypeVar("T")

MAX_CONTINUES = 100  # pages of lists held for their `continue`


def _status(code: int, reason: str, message: str) -> Obj:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class ApiServer(Pods):
    """The stand-in; `await start()`, then `url` (and `write_kubeconfig`). The pods, their
    history and the test's hand on them and on the watches: Pods (tests/support/fakes/pods.py)."""

    def __init__(self, token: str | None = None, gone_status: bool = False) -> None:
        super().__init__(gone_status)
        self.token = token  # None: no Authorization checked
        self.port = 0
        self.lists = 0  # list requests answered (each page counts)
        self.watches = 0  # watch requests made
        self._continues: dict[str, tuple[int, list[Obj]]] = {}
        self._tokens = itertools.count(1)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()

    # -- life -------------------------------------------------------------------------

    async def start(self) -> None:
        """Listen (on the port it had before, if it was started before)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Down: no listener, every connection cut (the pods and history stay)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        for writer in list(self._connections):
            writer.transport.abort()
        self._connections.clear()
        if self._handlers:
            await asyncio.wait(self._handlers, timeout=5)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def write_kubeconfig(self, path: Path, namespace: str = "default") -> Path:
        """A kubeconfig whose current context is this server (and its token)."""
        user = {"token": self.token} if self.token else {}
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "stand-in", "cluster": {"server": self.url}}],
            "users": [{"name": "stand-in", "user": user}],
            "contexts": [
                {
                    "name": "stand-in",
                    "context": {"cluster": "stand-in", "user": "stand-in", "namespace": namespace},
                }
            ],
            "current-context": "stand-in",
        }
        path.write_text(json.dumps(config, indent=2))  # JSON is YAML
        return path

    # -- HTTP -----------------------------------------------------------------------------

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        try:
            while True:
                try:
                    head = await reader.readuntil(b"\r\n\r\n")
                except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, OSError):
                    return
                lines = head.decode("latin-1").split("\r\n")
                method, target, _ = lines[0].split(" ", 2)
                headers = {}
                for line in lines[1:]:
                    if ":" in line:
                        key, value = line.split(":", 1)
                        headers[key.strip().lower()] = value.strip()
                if not await self._request(method, target, headers, reader, writer):
                    return
        except (ConnectionError, OSError):
            return
        finally:
            self._connections.discard(writer)
            self._handlers.discard(task)
            writer.transport.abort()

    async def _request(
        self,
        method: str,
        target: str,
        headers: dict[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        """Answer one request; whether the connection can take another."""
        if self.token is not None and headers.get("authorization") != f"Bearer {self.token}":
            return await self._answer(writer, 401, _status(401, "Unauthorized", "Unauthorized"))
        parts = urlsplit(target)
        path = parts.path.strip("/").split("/")
        query = {k: v[-1] for k, v in parse_qs(parts.query).items()}
        if (
            method != "GET"
            or len(path) != 5
            or path[:3] != ["api", "v1", "namespaces"]
            or path[4] != "pods"
        ):
            return await self._answer(writer, 404, _status(404, "NotFound", f"no {target}"))
        try:
            terms = selector_terms(query.get("labelSelector", ""))
            if query.get("fieldSelector"):
                raise BadRequest("field selectors are not modelled")
            if query.get("watch") in ("true", "1"):
                return await self._watch(path[3], terms, query, reader, writer)
            return await self._list(path[3], terms, query, writer)
        except BadRequest as exc:
            return await self._answer(writer, 400, _status(400, "BadRequest", str(exc)))

    async def _answer(self, writer: asyncio.StreamWriter, code: int, body: Obj) -> bool:
        data = json.dumps(body).encode()
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found"}
        writer.write(
            f"HTTP/1.1 {code} {reason.get(code, 'Gone')}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        return True

    async def _list(
        self,
        namespace: str,
        terms: list[tuple[str, str, str | None]],
        query: dict[str, str],
        writer: asyncio.StreamWriter,
    ) -> bool:
        self.lists += 1
        token = query.get("continue")
        if token:
            if token not in self._continues:
                return await self._answer(writer, 410, _status(410, "Expired", "continue expired"))
            version, items = self._continues.pop(token)
        else:
            version = self.version
            items = sorted(
                (copy.deepcopy(p) for (ns, _), p in self._pods.items() if ns == namespace),
                key=lambda p: str(p["metadata"]["name"]),
            )
            items = [p for p in items if matches(terms, p)]
        limit = int(query.get("limit") or 0)
        metadata: Obj = {"resourceVersion": str(version)}
        if limit and len(items) > limit:
            items, rest = items[:limit], items[limit:]
            token = f"page-{next(self._tokens)}"
            self._continues[token] = (version, rest)
            while len(self._continues) > MAX_CONTINUES:
                del self._continues[next(iter(self._continues))]
            metadata["continue"] = token
        body = {"kind": "PodList", "apiVersion": "v1", "metadata": metadata, "items": items}
        return await self._answer(writer, 200, body)

    async def _watch(
        self,
        namespace: str,
        terms: list[tuple[str, str, str | None]],
        query: dict[str, str],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        self.watches += 1
        since = query.get("resourceVersion", "")
        if since not in ("", "0") and not since.isdigit():
            raise BadRequest(f"resourceVersion {since!r} is not a version")
        too_old = since not in ("", "0") and int(since) < self._compacted
        if too_old and self.gone_status:
            gone = _status(410, "Expired", f"too old resource version: {since} ({self.version})")
            return await self._answer(writer, 410, gone)
        writer.write(
            b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n"
        )
        watch = Watch(namespace, terms, query.get("allowWatchBookmarks") == "true", writer)

        def send(event: Obj) -> None:
            writer.write(_chunk(json.dumps(event).encode() + b"\n"))

        if too_old:
            gone = _status(410, "Expired", f"too old resource version: {since} ({self.version})")
            send({"type": "ERROR", "object": gone})
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        # What happened since `since` (or the pods now), and registered, in one step: no
        # change can fall between the two.
        if since in ("", "0"):
            for (ns, _), pod in sorted(self._pods.items()):
                if ns == namespace and matches(terms, pod):
                    send({"type": "ADDED", "object": pod})
        else:
            for change in self._history:
                if change.namespace == namespace and change.version > int(since):
                    event = self._event(watch, change)
                    if event is not None:
                        send(event)
        self._watching.add(watch)
        gone_client = asyncio.ensure_future(reader.read(1))  # b"": the client left
        timeout = float(query["timeoutSeconds"]) if query.get("timeoutSeconds") else None
        try:
            async with asyncio.timeout(timeout):
                while True:
                    await writer.drain()
                    getter = asyncio.ensure_future(watch.queue.get())
                    await asyncio.wait((getter, gone_client), return_when=asyncio.FIRST_COMPLETED)
                    if not getter.done():
                        getter.cancel()
                        return False
                    what, detail = getter.result()
                    if what == "change":
                        event = self._event(watch, detail)
                        if event is not None:
                            send(event)
                    elif what == "bookmark":
                        meta = {"resourceVersion": str(detail)}
                        send({"type": "BOOKMARK", "object": {"kind": "Pod", "metadata": meta}})
                    elif what == "expire":
                        gone = _status(410, "Expired", "too old resource version")
                        send({"type": "ERROR", "object": gone})
                        break
                    else:  # end
                        break
        except TimeoutError:
            pass
        finally:
            self._watching.discard(watch)
            left = gone_client.done()
            gone_client.cancel()  # and wait, before the connection's next request is read
            await asyncio.gather(gone_client, return_exceptions=True)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return not left


@contextlib.asynccontextmanager
async def running(token: str | None = None, gone_status: bool = False) -> AsyncIterator[ApiServer]:
    """A started stand-in, stopped after."""
    server = ApiServer(token=token, gone_status=gone_status)
    await server.start()
    try:
        yield server
    finally:
        await server.stop()


class InThread:
    """The stand-in on an event loop of its own, in a thread: for a test whose own loop
    blocks (starting `gateway serve` waits for its READY line, which may wait for the
    discovery's first list). `do` runs a test call (`add_pod`, ...) on that loop."""

    def __init__(self, token: str | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.server = ApiServer(token=token)
        self._wait(self.server.start())

    def _wait(self, work: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(work, self._loop).result(10)

    def do(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async def run() -> T:
            return call(*args, **kwargs)

        return self._wait(run())

    def close(self) -> None:
        self._wait(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)
        self._loop.close()
