"""What an HTTP/2 connection reports to its adapter: our own event types.

`proxycore.protocol.http2.connection.H2Server.receive_data` reports these (past tense: what the
client did) to the adapter (proxycore/io/http2.py); `client.H2Client` reports them to
proxycore/io/upstream_h2.py. Header names are lowercase bytes, values bytes, pseudo-header
fields taken out.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "ConnectionEnded",
    "DataReceived",
    "H2Event",
    "PingReceived",
    "RequestReceived",
    "ResponseReceived",
    "SettingsReceived",
    "StreamEnded",
    "StreamReset",
    "TrailersReceived",
    "WindowOpened",
]


class RequestReceived(msgspec.Struct, frozen=True):
    """A request head, as the exchange needs it (RFC 9113 8.3.1)."""

    stream_id: int
    method: bytes
    scheme: bytes  # b"" for CONNECT (RFC 9113 8.5)
    authority: bytes  # :authority, or the Host field when :authority is absent
    path: bytes  # b"" for CONNECT
    headers: tuple[tuple[bytes, bytes], ...]  # regular fields, lowercase names, in order
    ended: bool  # END_STREAM on the head: no body follows
    # RFC 9113 8.5 extended CONNECT (RFC 8441): the :protocol pseudo-header, else b"".
    protocol: bytes = b""
    # Why the request is malformed (RFC 9113 8.1.1: pseudo-headers), "" if it is not; the
    # adapter answers it 400 on its stream.
    malformed: str = ""


class DataReceived(msgspec.Struct, frozen=True):
    """Request body bytes; `flow_length` (padding included) is what to acknowledge once the
    bytes are consumed (`H2Server.acknowledge`)."""

    stream_id: int
    data: bytes
    flow_length: int
    ended: bool


class StreamEnded(msgspec.Struct, frozen=True):
    """The client ended its side of the stream (END_STREAM)."""

    stream_id: int


class TrailersReceived(msgspec.Struct, frozen=True):
    """A trailer section (RFC 9113 8.1), pseudo-header fields taken out; END_STREAM follows
    (a `StreamEnded`)."""

    stream_id: int
    headers: tuple[tuple[bytes, bytes], ...]


class ResponseReceived(msgspec.Struct, frozen=True):
    """The final response head from an upstream (client side, RFC 9113 8.3.2)."""

    stream_id: int
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    ended: bool  # END_STREAM on the head: no body follows


class StreamReset(msgspec.Struct, frozen=True):
    """The stream is gone: reset by the client (`by_peer`) or by the connection's limits."""

    stream_id: int
    error_code: int
    by_peer: bool
    why: str = ""
    # Client side: the upstream never processed the stream (REFUSED_STREAM, or above the
    # last stream identifier of its GOAWAY, RFC 9113 8.7): it may be sent again.
    refused: bool = False


class WindowOpened(msgspec.Struct, frozen=True):
    """The client opened a send window (stream 0: the connection's): blocked sends may go on."""

    stream_id: int


class SettingsReceived(msgspec.Struct, frozen=True):
    """The client changed its settings (acknowledged already)."""

    changed: tuple[tuple[int, int], ...]


class PingReceived(msgspec.Struct, frozen=True):
    """A PING (answered already)."""


class ConnectionEnded(msgspec.Struct, frozen=True):
    """The client sent GOAWAY: no new streams; the open ones may finish."""

    error_code: int
    last_stream_id: int


H2Event = (
    RequestReceived
    | DataReceived
    | StreamEnded
    | StreamReset
    | WindowOpened
    | SettingsReceived
    | PingReceived
    | ConnectionEnded
    | TrailersReceived
    | ResponseReceived
)
