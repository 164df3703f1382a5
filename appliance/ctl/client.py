"""The typed admin client: one method per route of applianced's admin API, msgspec bodies.

appliancectl's commands and the tests (tests/daemon_support.py) use it; requests and answers
are the Structs of appliance/daemon/messages.py, so a renamed field breaks here and in mypy,
not in a user's terminal. The transport (http.py) and the run session (session.py) are shared
with the `run` fast path, which cannot afford msgspec's import (~25 ms).

Errors: `Unreachable` (nothing answered, or not in the admin API's terms) and `AdminError` (the
answer's status, error code and message); `exits.for_status` turns the latter into an exit code.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator
from typing import Any, TypeVar

import msgspec

from appliance.daemon import messages

from . import http, session
from .http import DEFAULT_ADMIN_SOCKET, AdminError, Unreachable

T = TypeVar("T")

__all__ = ["DEFAULT_ADMIN_SOCKET", "AdminClient", "AdminError", "Unreachable"]


def _segment(name: str) -> str:
    return urllib.parse.quote(name, safe="")


def _query(**params: object) -> str:
    pairs = {k: v for k, v in params.items() if v is not None and v is not False}
    return ("?" + urllib.parse.urlencode(pairs)) if pairs else ""


class AdminClient:
    def __init__(self, path: str | http.Endpoint, timeout: float | None = 600.0) -> None:
        self.path = path
        self.timeout = timeout

    # -- the plumbing ---------------------------------------------------------------------

    def _request(self, method: str, target: str, body: object | None) -> http.Response:
        data = None if body is None else messages.encoder.encode(body)
        return http.request(self.path, method, target, data, timeout=self.timeout)

    def call(self, method: str, target: str, body: object | None, kind: type[T]) -> T:
        """One request; the answer decoded as `kind` (a messages Struct)."""
        response = self._request(method, target, body)
        try:
            raw = response.body()
        except (OSError, http.ProtocolError) as exc:
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        finally:
            response.close()
        try:
            return msgspec.json.decode(raw, type=kind)
        except msgspec.DecodeError as exc:  # ValidationError included
            raise Unreachable(f"applianced on {self.path}: unexpected answer: {exc}") from None

    def lines(self, target: str, *, timeout: float | None = None) -> Iterator[bytes]:
        """A streamed JSON-lines answer, one raw line (with its newline) at a time."""
        response = http.request(self.path, "GET", target, timeout=timeout)
        try:
            yield from response.lines()
        except (OSError, http.ProtocolError) as exc:
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        finally:
            response.close()

    def _entries(self, target: str, *, timeout: float | None = None) -> Iterator[Any]:
        decoder = msgspec.json.Decoder(messages.JournalEntry)
        for line in self.lines(target, timeout=timeout):
            try:
                yield decoder.decode(line)
            except msgspec.DecodeError as exc:
                raise Unreachable(f"applianced on {self.path}: unexpected line: {exc}") from None

    # -- daemon ---------------------------------------------------------------------------

    def status(self) -> messages.Status:
        return self.call("GET", "/v1/status", None, messages.Status)

    def net(self) -> messages.NetReport:
        return self.call("GET", "/v1/net", None, messages.NetReport)

    # -- crews ----------------------------------------------------------------------------

    def crews(self) -> messages.CrewList:
        return self.call("GET", "/v1/crews", None, messages.CrewList)

    def crew(self, name: str) -> messages.CrewInfo:
        return self.call("GET", f"/v1/crews/{_segment(name)}", None, messages.CrewInfo)

    def create_crew(self, request: messages.CreateCrew) -> messages.CrewInfo:
        return self.call("POST", "/v1/crews", request, messages.CrewInfo)

    def remove_crew(self, name: str) -> messages.Removed:
        return self.call("DELETE", f"/v1/crews/{_segment(name)}", None, messages.Removed)

    def allow(self, name: str, host: str) -> messages.AllowResult:
        target = f"/v1/crews/{_segment(name)}/allow"
        return self.call("POST", target, messages.AllowHost(host=host), messages.AllowResult)

    def set_net(self, name: str, net: tuple[str, ...]) -> messages.NetResult:
        target = f"/v1/crews/{_segment(name)}/net"
        return self.call("POST", target, messages.SetNet(net=net), messages.NetResult)

    def run(
        self,
        name: str,
        argv: list[str],
        timeout: float | None = None,
        *,
        stdin: bool = False,
        tty: bool = False,
        size: tuple[int, int] | None = None,
    ) -> session.Session:
        """A run session (session.py): send_stdin, close_stdin, signal, resize, frames()."""
        request = messages.RunCommand(
            argv=tuple(argv),
            timeout=timeout,
            stdin=stdin,
            tty=tty,
            rows=size[0] if size else None,
            columns=size[1] if size else None,
        )
        body = messages.encoder.encode(request)
        return session.open_session(self.path, _segment(name), body)

    # -- approvals ------------------------------------------------------------------------

    def approvals(
        self, *, crew: str | None = None, since: int = 0, wait: float = 0.0
    ) -> messages.ApprovalList:
        query = _query(crew=crew, since=since or None, wait=wait or None)
        return self.call("GET", f"/v1/approvals{query}", None, messages.ApprovalList)

    def approve(self, crew: str, decision: messages.ApprovalDecision) -> messages.ApprovalResult:
        target = f"/v1/approvals/{_segment(crew)}/allow"
        return self.call("POST", target, decision, messages.ApprovalResult)

    def deny(self, crew: str, decision: messages.ApprovalDecision) -> messages.ApprovalResult:
        target = f"/v1/approvals/{_segment(crew)}/deny"
        return self.call("POST", target, decision, messages.ApprovalResult)

    # -- credentials ----------------------------------------------------------------------

    def credentials(self) -> messages.CredentialList:
        return self.call("GET", "/v1/credentials", None, messages.CredentialList)

    def add_credential(self, request: messages.AddCredential) -> messages.CredentialInfo:
        return self.call("POST", "/v1/credentials", request, messages.CredentialInfo)

    def _credential(self, name: str, action: str, request: object) -> messages.CredentialInfo:
        target = f"/v1/credentials/{_segment(name)}/{action}"
        return self.call("POST", target, request, messages.CredentialInfo)

    def grant(self, name: str, request: messages.GrantCredential) -> messages.CredentialInfo:
        return self._credential(name, "grant", request)

    def revoke(self, name: str, request: messages.RevokeCredential) -> messages.CredentialInfo:
        return self._credential(name, "revoke", request)

    def rotate(self, name: str, request: messages.RotateCredential) -> messages.CredentialInfo:
        return self._credential(name, "rotate", request)

    # -- journal --------------------------------------------------------------------------

    def journal_tail(
        self, n: int = 20, *, crew: str | None = None, type: str | None = None, after: int = 0
    ) -> messages.JournalEntries:
        query = _query(n=n, crew=crew, type=type, after=after or None)
        return self.call("GET", f"/v1/journal{query}", None, messages.JournalEntries)

    def journal_search(
        self, text: str, n: int = 50, *, fts: bool = False
    ) -> messages.JournalEntries:
        """Entries whose summary or payload hold every word of `text` (each one literal); with
        fts, `text` is an FTS5 query (docs/journal.md)."""
        query = _query(**{"match" if fts else "q": text}, n=n)
        return self.call("GET", f"/v1/journal/search{query}", None, messages.JournalEntries)

    def journal_verify(self) -> messages.JournalVerify:
        return self.call("GET", "/v1/journal/verify", None, messages.JournalVerify)

    def journal_export(
        self, *, since: float | None = None, until: float | None = None, crew: str | None = None
    ) -> Iterator[bytes]:
        """A signed export (appliance/journal/export.py): its header, the entries oldest first,
        the signed end, as the JSON lines applianced sends (bytes, newline)."""
        return self.lines(f"/v1/journal/export{_query(since=since, until=until, crew=crew)}")

    def journal_prune(self, request: messages.JournalPrune) -> messages.JournalPruned:
        return self.call("POST", "/v1/journal/prune", request, messages.JournalPruned)

    def journal_backup(self, path: str) -> messages.JournalBackup:
        return self.call("POST", "/v1/journal/backup", {"path": path}, messages.JournalBackup)

    def metrics(self) -> bytes:
        """The Prometheus text exposition applianced serves."""
        response = self._request("GET", "/metrics", None)
        try:
            return response.body()
        except (OSError, http.ProtocolError) as exc:
            raise Unreachable(f"applianced on {self.path}: {exc}") from None
        finally:
            response.close()

    def events(
        self,
        *,
        crew: str | None = None,
        type: str | None = None,
        since: float | None = None,
        after: int | None = None,
        n: int | None = None,
        follow: bool = False,
    ) -> Iterator[messages.JournalEntry]:
        """Journal entries as they are written (follow), from `since` (a wall-clock time),
        after seq `after`, or the last n; oldest first."""
        query = _query(crew=crew, type=type, since=since, after=after, n=n, follow=follow and 1)
        return self._entries(f"/v1/events{query}", timeout=None if follow else self.timeout)
