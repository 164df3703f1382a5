"""Parsed message heads: the bytes as received, the facts framing needs, fields split lazily."""

from __future__ import annotations

from proxycore.protocol.http1.grammar import TRANSFER_ENCODING, BodyKind

__all__ = ["RequestHead", "ResponseHead", "split_fields"]


class _Head:
    """What request and response heads share: the bytes as received, and fields split lazily.

    Read-only by convention (plain slots, not a frozen dataclass: building one per message is on
    the hot path, and the relay fast path never needs the field list, only `raw`).
    """

    __slots__ = (
        "_headers",
        "body_kind",
        "content_length",
        "http_version",
        "keep_alive",
        "nominates",
        "raw",
        "start_len",
    )

    raw: bytes  # the head exactly as received, start line through the final CRLF CRLF
    start_len: int  # length of the start line (without its CRLF)
    http_version: bytes
    body_kind: BodyKind
    content_length: int
    keep_alive: bool
    # A Connection field names fields beyond close, keep-alive and the hop-by-hop set: the
    # relay must take the general path (`strip_hop_by_hop`) rather than `relay_fields`.
    nominates: bool
    _headers: tuple[tuple[bytes, bytes], ...] | None

    @property
    def headers(self) -> tuple[tuple[bytes, bytes], ...]:
        """(lowercased name, value) pairs in order; Transfer-Encoding values lowercased."""
        headers = self._headers
        if headers is None:
            headers = self._headers = split_fields(self.raw[:-4])
        return headers

    def get(self, name: bytes) -> bytes | None:
        """The first value of header `name` (lowercase), or None: `headers`' answer, without
        splitting every field when they are not split yet (a response's content-type is often
        the only field read in Python: splitting them all cost more than the rest of the read).
        """
        headers = self._headers
        if headers is not None:
            for key, value in headers:
                if key == name:
                    return value
            return None
        # The parser accepts field lines only as `token ":" value` right after a CRLF: no
        # whitespace before the colon, no obs-fold, no CR or LF in a value (parse.py). So the
        # first field line named `name` (a token: no colon in it) starts at the first CRLF
        # name ":" of the lowercased head, which cannot fall in the start line or the final
        # CRLF CRLF; its value runs to the next CRLF.
        raw = self.raw
        at = raw.lower().find(b"\r\n" + name + b":", 0, len(raw) - 4)
        if at < 0:
            return None
        begin = at + 3 + len(name)
        value = raw[begin : raw.find(b"\r\n", begin)].strip(b" \t")
        return value.lower() if name == TRANSFER_ENCODING else value

    def _key(self) -> tuple[object, ...]:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        # Heads compare by what was read, as the frozen dataclasses they replace did.
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Head)
        return self._key() == other._key()

    __hash__ = None  # type: ignore[assignment]


class RequestHead(_Head):
    """A parsed request line and header section."""

    __slots__ = ("expect_continue", "method", "target")

    def __init__(
        self,
        raw: bytes,
        start_len: int,
        method: bytes,
        target: bytes,
        http_version: bytes,
        body_kind: BodyKind,
        content_length: int,
        keep_alive: bool,
        expect_continue: bool,
        nominates: bool,
    ) -> None:
        self.raw = raw
        self.start_len = start_len
        self.method = method
        self.target = target
        self.http_version = http_version
        self.body_kind = body_kind
        self.content_length = content_length
        self.keep_alive = keep_alive
        self.expect_continue = expect_continue
        self.nominates = nominates
        self._headers = None

    def _key(self) -> tuple[object, ...]:
        return (
            self.method,
            self.target,
            self.http_version,
            self.headers,
            self.body_kind,
            self.content_length,
            self.keep_alive,
            self.expect_continue,
        )

    def __repr__(self) -> str:
        return f"RequestHead({self.method!r}, {self.target!r}, {self.http_version!r})"


class ResponseHead(_Head):
    """A parsed status line and header section."""

    __slots__ = ("reason", "status")

    def __init__(
        self,
        raw: bytes,
        start_len: int,
        status: int,
        reason: bytes,
        http_version: bytes,
        body_kind: BodyKind,
        content_length: int,
        keep_alive: bool,
        nominates: bool,
    ) -> None:
        self.raw = raw
        self.start_len = start_len
        self.status = status
        self.reason = reason
        self.http_version = http_version
        self.body_kind = body_kind
        self.content_length = content_length
        self.keep_alive = keep_alive
        self.nominates = nominates
        self._headers = None

    def _key(self) -> tuple[object, ...]:
        return (
            self.status,
            self.reason,
            self.http_version,
            self.headers,
            self.body_kind,
            self.content_length,
            self.keep_alive,
        )

    def __repr__(self) -> str:
        return f"ResponseHead({self.status}, {self.reason!r}, {self.http_version!r})"


def split_fields(head: bytes) -> tuple[tuple[bytes, bytes], ...]:
    """All field lines of an accepted head (without its final CRLF CRLF) as (lowercased name,
    value without surrounding OWS); Transfer-Encoding values lowercased, as h11 reads them."""
    fields: list[tuple[bytes, bytes]] = []
    append = fields.append
    lines = head.split(b"\r\n")
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.lower()
        # RFC 9112 5: OWS around the value is not part of it.
        value = value.strip(b" \t")
        if name == TRANSFER_ENCODING:
            value = value.lower()
        append((name, value))
    return tuple(fields)
