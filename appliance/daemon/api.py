"""The admin API: HTTP/1.1 (h11) with JSON bodies on a root-only Unix socket.

Theory of operation
-------------------
The control plane, not the hot path, so h11 (strict, well tested) parses it. The socket is
created 0600 under a 0700 directory, and every connection's peer credentials (SO_PEERCRED) must
be root or applianced's own user: file modes are the first gate, the kernel's word the second.
One request per connection (`Connection: close`): appliancectl opens a connection per command.

Every endpoint is one row of ROUTES (method, path pattern, handler); `{name}` matches one path
segment. A path that matches with another method is 405; no match is 404. Request and answer
bodies are the Structs of messages.py; appliance/ctl/client.py has one method per row.

    GET    /v1/status                  Status (with `health`: each part judged, health.py)
    GET    /v1/crews                   CrewList
    POST   /v1/crews                   CreateCrew -> 201 CrewInfo
    GET    /v1/crews/{name}            CrewInfo
    DELETE /v1/crews/{name}            Removed
    POST   /v1/crews/{name}/allow      AllowHost -> AllowResult
    POST   /v1/crews/{name}/net        SetNet -> NetResult
    POST   /v1/crews/{name}/run        RunCommand, `Upgrade: appliance-run/1` -> 101, then
                                       frames both ways (framing.py): output, stdin, signals,
                                       resize, the exit status
    GET    /v1/approvals?crew=&since=&wait=   ApprovalList: pending requests filed after
                                       `since` (a long poll: waits up to `wait` s, at most 60,
                                       for one), the grants and denials in force (approvals.py)
    POST   /v1/approvals/{name}/allow|deny   ApprovalDecision -> ApprovalResult
    GET    /v1/net                     NetReport (crews by name, then free pool slots)
    GET    /v1/credentials             CredentialList; POST AddCredential -> 201 CredentialInfo
    POST   /v1/credentials/{name}/grant|revoke|rotate   -> CredentialInfo (credentials.py)
    GET    /v1/journal?n=&crew=&type=&after=   JournalEntries, oldest first
    GET    /v1/journal/search?q=&n=    JournalEntries holding every word of q (each a literal
                                       FTS5 phrase); ?match= takes an FTS5 query as it is
    GET    /v1/journal/export?since=&until=&crew=   200, JSON lines: a signed export
                                       (appliance/journal/export.py: header, rows, signed end)
    GET    /v1/journal/verify          JournalVerify (200 whether or not it is ok; from the
                                       signed checkpoint when retention cut the journal)
    POST   /v1/journal/prune           PruneRequest -> PruneReport (409 tampered: nothing removed)
    POST   /v1/journal/backup          {"path": absolute} -> BackupReport (a signed copy)
    GET    /v1/events?crew=&type=&n=&after=&since=&follow=1   JSON lines of JournalEntry; with
                                       follow, new entries as they are written, until the
                                       client goes away
    GET    /metrics                    Prometheus text exposition (appliance/daemon/metrics.py)

Errors are `{"error": code, "message": text}` with the status the error class carries
(errors.py): 400 invalid (names the argument), 404 not_found, 405, 409 exists/conflict, 503
unavailable, 500 failed/internal. A request head must arrive within HEAD_TIMEOUT and a body is
capped at MAX_BODY.

Each request's log records carry a request id (a run's is its journal trace id) and the crew it
names. A client that goes away mid-answer (Ctrl-C, a killed `appliancectl`, a closed pipe) is not
an error: one INFO line, no traceback.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import urllib.parse
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import h11
import msgspec
import trio

from . import framing, health, messages
from .errors import DaemonError, InvalidRequest

if TYPE_CHECKING:
    from .main import Daemon

log = logging.getLogger("applianced.api")

MAX_BODY = 1 << 20
HEAD_TIMEOUT = 10.0
MAX_ENTRIES = 10_000
FOLLOW_POLL = 0.25  # seconds between looks at the journal for `events?follow=1`


class _Reply(msgspec.Struct, frozen=True):
    status: int
    body: Any


class _NotFound(DaemonError):
    status = 404
    code = "not_found"


class _MethodNotAllowed(DaemonError):
    status = 405
    code = "method_not_allowed"


def decode(body: bytes, kind: type[Any]) -> Any:
    try:
        return msgspec.json.decode(body or b"{}", type=kind)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"bad request body: {exc}") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not JSON: {exc}") from None


def fts_phrases(text: str) -> str:
    """Plain text as an FTS5 query: each whitespace-separated word a quoted string (a phrase of
    its tokens), all of them required. `denied.test` is the phrase "denied test"; `OR`, `NEAR`,
    `-`, `*`, `:` and quotes are text, never operators (FTS5's string syntax: "" for a quote)."""
    words = text.split()
    if not words:
        raise InvalidRequest("argument q: needs something to search for")
    return " ".join('"' + word.replace('"', '""') + '"' for word in words)


@dataclass(frozen=True)
class Request:
    method: str
    path: str
    params: dict[str, str]  # the pattern's {name} segments, decoded
    query: dict[str, list[str]]
    body: bytes
    stream: trio.abc.Stream
    conn: h11.Connection
    headers: dict[str, str]

    def arg(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None

    def number(self, name: str, default: int, limit: int = MAX_ENTRIES) -> int:
        text = self.arg(name)
        if text is None:
            return default
        if not text.isdigit():
            raise InvalidRequest(f"argument {name}: {text!r} is not a non-negative integer")
        return min(int(text), limit)

    def real(self, name: str) -> float | None:
        text = self.arg(name)
        if text is None:
            return None
        try:
            return float(text)
        except ValueError:
            raise InvalidRequest(f"argument {name}: {text!r} is not a number") from None


Handler = Callable[["Handlers", Request], Awaitable[_Reply | None]]


class Handlers:
    """The endpoints over the daemon (the backend): one method per row of ROUTES. A method
    that answers itself (a stream, an upgrade) returns None."""

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon

    # -- daemon ---------------------------------------------------------------------------

    async def status(self, request: Request) -> _Reply:
        daemon = self.daemon
        status = await daemon.status()
        parts = await health.judge(
            status, daemon.provider, getattr(daemon, "recorder", None), daemon.journal
        )
        return _Reply(200, msgspec.structs.replace(status, health=parts))

    async def net(self, request: Request) -> _Reply:
        return _Reply(200, await self.daemon.crews.net_report())

    # -- crews ----------------------------------------------------------------------------

    async def crews(self, request: Request) -> _Reply:
        return _Reply(200, messages.CrewList(tuple(await self.daemon.crews.list_crews())))

    async def create_crew(self, request: Request) -> _Reply:
        crews = self.daemon.crews
        create = decode(request.body, messages.CreateCrew)
        if crews.store.get(create.name) is None:
            # A new crew starts with no grant or denial, whatever a former crew of that name
            # (removed by reconcile or a rolled-back create) left in applianced's memory.
            self.daemon.approvals.forget_crew(create.name)
        row = await crews.create(create)
        return _Reply(201, await crews.info(row))

    async def crew(self, request: Request) -> _Reply:
        return _Reply(200, await self.daemon.crews.show(request.params["name"]))

    async def remove_crew(self, request: Request) -> _Reply:
        name = request.params["name"]
        await self.daemon.crews.remove(name)
        self.daemon.approvals.forget_crew(name)
        return _Reply(200, messages.Removed(crew=name))

    async def allow(self, request: Request) -> _Reply:
        name = request.params["name"]
        allow = decode(request.body, messages.AllowHost)
        changed = await self.daemon.crews.allow(name, allow.host)
        return _Reply(200, messages.AllowResult(crew=name, host=allow.host, changed=changed))

    async def set_net(self, request: Request) -> _Reply:
        name = request.params["name"]
        body = decode(request.body, messages.SetNet)
        net, changed = await self.daemon.crews.set_net(name, body.net)
        return _Reply(200, messages.NetResult(crew=name, net=net, changed=changed))

    async def run(self, request: Request) -> None:
        from .run_session import serve_run

        run = decode(request.body, messages.RunCommand)
        if request.headers.get("upgrade", "").lower() != framing.UPGRADE:
            raise InvalidRequest(f"run: needs `Upgrade: {framing.UPGRADE}` (framing.py)")
        await serve_run(self.daemon, request.params["name"], run, request.stream, request.conn)
        return None

    # -- approvals (approvals.py journals its own answers) -------------------------------------

    async def approvals(self, request: Request) -> _Reply:
        wait = request.real("wait") or 0.0
        if not 0 <= wait < float("inf"):
            raise InvalidRequest(f"argument wait: {wait!r} is not a number of seconds >= 0")
        crew = request.arg("crew")
        since = request.number("since", 0, limit=1 << 62)
        return _Reply(200, await self.daemon.approvals.listing(crew, since, wait))

    async def approve(self, request: Request) -> _Reply:
        decision = decode(request.body, messages.ApprovalDecision)
        return _Reply(200, await self.daemon.approvals.allow(request.params["name"], decision))

    async def deny(self, request: Request) -> _Reply:
        decision = decode(request.body, messages.ApprovalDecision)
        return _Reply(200, await self.daemon.approvals.deny(request.params["name"], decision))

    # -- credentials (credentials.py journals its own changes) -----------------------------

    async def credentials(self, request: Request) -> _Reply:
        return _Reply(200, self.daemon.credentials_api.listing())

    async def add_credential(self, request: Request) -> _Reply:
        add = decode(request.body, messages.AddCredential)
        return _Reply(201, await self.daemon.credentials_api.add(add, self.daemon.recorder))

    async def grant(self, request: Request) -> _Reply:
        grant = decode(request.body, messages.GrantCredential)
        api, name = self.daemon.credentials_api, request.params["name"]
        return _Reply(200, await api.grant(name, grant, self.daemon.recorder))

    async def revoke(self, request: Request) -> _Reply:
        revoke = decode(request.body, messages.RevokeCredential)
        api, name = self.daemon.credentials_api, request.params["name"]
        return _Reply(200, await api.revoke(name, revoke, self.daemon.recorder))

    async def rotate(self, request: Request) -> _Reply:
        rotate = decode(request.body, messages.RotateCredential)
        api, name = self.daemon.credentials_api, request.params["name"]
        return _Reply(200, await api.rotate(name, rotate, self.daemon.recorder))

    # -- journal --------------------------------------------------------------------------

    async def _journal_call(self, call: Callable[[], Any]) -> Any:
        from appliance.journal import JournalError

        try:
            return await trio.to_thread.run_sync(call)
        except JournalError as exc:
            raise InvalidRequest(str(exc)) from None

    async def journal(self, request: Request) -> _Reply:
        call = functools.partial(
            self.daemon.journal.tail,
            request.number("n", 20),
            crew=request.arg("crew"),
            type=request.arg("type"),
            after=request.number("after", 0, limit=1 << 62),
        )
        return _Reply(200, {"entries": await self._journal_call(call)})

    async def journal_search(self, request: Request) -> _Reply:
        match = request.arg("match")
        query = match if match is not None else fts_phrases(request.arg("q") or "")
        if not query.strip():
            raise InvalidRequest("argument match: needs an FTS5 query")
        call = functools.partial(self.daemon.journal.search, query, request.number("n", 50))
        return _Reply(200, {"entries": await self._journal_call(call)})

    async def journal_verify(self, request: Request) -> _Reply:
        return _Reply(200, await self._journal_call(self.daemon.journal_lifecycle.verify))

    async def journal_export(self, request: Request) -> None:
        from appliance.journal.export import ExportFilter

        where = ExportFilter(
            since=request.real("since"), until=request.real("until"), crew=request.arg("crew")
        )
        lines = await self._journal_call(
            functools.partial(self.daemon.journal_lifecycle.export, where)
        )
        await _send_lines(request, _pages(lines))
        return None

    async def journal_prune(self, request: Request) -> _Reply:
        """PruneRequest -> PruneReport; 409 `tampered` when what it would remove does not
        verify (nothing is removed then)."""
        from appliance.journal.retention import JournalTampered, PruneRequest

        prune = decode(request.body, PruneRequest)
        try:
            report = await self._journal_call(
                functools.partial(self.daemon.journal_lifecycle.prune, prune)
            )
        except JournalTampered as exc:
            return _Reply(409, messages.ErrorBody("tampered", str(exc)))
        return _Reply(200, report)

    async def journal_backup(self, request: Request) -> _Reply:
        path = decode(request.body, dict[str, str]).get("path")
        if not path:
            raise InvalidRequest("argument path: give the backup file")
        try:
            report = await self._journal_call(
                functools.partial(self.daemon.journal_lifecycle.backup, path)
            )
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        return _Reply(200, report)

    async def metrics(self, request: Request) -> None:
        data, content_type = self.daemon.metrics.exposition()
        headers = [
            ("Content-Type", content_type),
            ("Content-Length", str(len(data))),
            ("Connection", "close"),
        ]
        stream, conn = request.stream, request.conn
        await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
        await stream.send_all(conn.send(h11.Data(data=data)))
        await stream.send_all(conn.send(h11.EndOfMessage()))
        return None

    async def events(self, request: Request) -> None:
        """Entries as JSON lines: the last n (or those since a time, or after a seq), then with
        follow=1 each new one as it is written, until the client goes away."""
        journal = self.daemon.journal
        crew, kind = request.arg("crew"), request.arg("type")
        after = request.number("after", 0, limit=1 << 62)
        since = request.real("since")
        follow = request.arg("follow") not in (None, "", "0")
        if not after and since is None:
            # The last n entries, then everything after them.
            # The head first: an entry written between the two reads is then in both, and
            # `after` skips it once; none is lost.
            head = await self._journal_call(functools.partial(journal.tail, 1))
            last = await self._journal_call(
                functools.partial(journal.tail, request.number("n", 20), crew=crew, type=kind)
            )
            initial = list(last)
            after = max([row.seq for row in (*head, *initial)], default=0)
        else:
            initial = []

        async def pages() -> Any:
            nonlocal after
            if initial:
                yield initial
            while True:
                rows = await self._journal_call(
                    functools.partial(journal.tail, 1000, crew=crew, type=kind, after=after)
                )
                if since is not None:
                    rows = [row for row in rows if row.ts >= since]
                if rows:
                    after = max(after, rows[-1].seq)
                    yield rows
                    continue
                if not follow:
                    return
                await trio.sleep(FOLLOW_POLL)

        await _send_lines(request, pages())
        return None


# The admin API: every endpoint, once. (method, path pattern, handler)
ROUTES: tuple[tuple[str, str, Handler], ...] = (
    ("GET", "/v1/status", Handlers.status),
    ("GET", "/v1/net", Handlers.net),
    ("GET", "/v1/crews", Handlers.crews),
    ("POST", "/v1/crews", Handlers.create_crew),
    ("GET", "/v1/crews/{name}", Handlers.crew),
    ("DELETE", "/v1/crews/{name}", Handlers.remove_crew),
    ("POST", "/v1/crews/{name}/allow", Handlers.allow),
    ("POST", "/v1/crews/{name}/net", Handlers.set_net),
    ("POST", "/v1/crews/{name}/run", Handlers.run),
    ("GET", "/v1/approvals", Handlers.approvals),
    ("POST", "/v1/approvals/{name}/allow", Handlers.approve),
    ("POST", "/v1/approvals/{name}/deny", Handlers.deny),
    ("GET", "/v1/credentials", Handlers.credentials),
    ("POST", "/v1/credentials", Handlers.add_credential),
    ("POST", "/v1/credentials/{name}/grant", Handlers.grant),
    ("POST", "/v1/credentials/{name}/revoke", Handlers.revoke),
    ("POST", "/v1/credentials/{name}/rotate", Handlers.rotate),
    ("GET", "/v1/journal", Handlers.journal),
    ("GET", "/v1/journal/search", Handlers.journal_search),
    ("GET", "/v1/journal/export", Handlers.journal_export),
    ("GET", "/v1/journal/verify", Handlers.journal_verify),
    ("POST", "/v1/journal/prune", Handlers.journal_prune),
    ("POST", "/v1/journal/backup", Handlers.journal_backup),
    ("GET", "/v1/events", Handlers.events),
    ("GET", "/metrics", Handlers.metrics),
)


def route(method: str, path: str) -> tuple[Handler, dict[str, str]]:
    """The handler for a request and its path parameters; 404 or 405 otherwise."""
    segments = path.strip("/").split("/")
    allowed: list[str] = []
    for route_method, pattern, handler in ROUTES:
        parts = pattern.strip("/").split("/")
        if len(parts) != len(segments):
            continue
        params: dict[str, str] = {}
        for part, segment in zip(parts, segments, strict=True):
            if part.startswith("{"):
                if not segment:
                    break
                params[part[1:-1]] = urllib.parse.unquote(segment)
            elif part != segment:
                break
        else:
            if route_method == method:
                return handler, params
            allowed.append(route_method)
    if allowed:
        raise _MethodNotAllowed(f"{method} not allowed on {path} (only {', '.join(allowed)})")
    raise _NotFound(f"no such endpoint: {path}")


def _pages(rows: Iterator[Any]) -> Any:
    async def pages() -> Any:
        while True:
            # Pages of rows read off the trio thread; the sqlite reads never block the loop.
            page = await trio.to_thread.run_sync(lambda: list(itertools.islice(rows, 1000)))
            if not page:
                return
            yield page

    return pages()


async def _send_lines(request: Request, pages: Any) -> None:
    """A chunked JSON-lines answer (framing.py), a page of documents per chunk."""
    stream, conn = request.stream, request.conn
    headers = [
        ("Content-Type", "application/x-ndjson"),
        ("Transfer-Encoding", "chunked"),
        ("Connection", "close"),
    ]
    await stream.send_all(conn.send(h11.Response(status_code=200, headers=headers)))
    async with contextlib.aclosing(pages) as iterator:
        async for page in iterator:
            # Rows as documents; a signed export's lines come framed already (export.py).
            data = b"".join(
                row
                if isinstance(row, bytes)
                else framing.json_lines([messages.encoder.encode(row)])
                for row in page
            )
            await stream.send_all(conn.send(h11.Data(data=data)))
    await stream.send_all(conn.send(h11.EndOfMessage()))
