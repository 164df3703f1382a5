"""The server side of one HTTP/2 connection: the h2 package's state machine, wrapped once.

Theory of operation
-------------------
`H2Server` is sans-IO like the HTTP/1.1 parser: the adapter (proxycore/io/http2.py) feeds it the
bytes the client sent (`receive_data`), gets back our own events (`events.py`), calls commands
(`send_headers`, `send_data`, `reset`, `acknowledge`...) and writes out `data_to_send()`.
Nothing outside this module, `endpoint.py` (what both sides share) and `client.py` (the upstream
side) touches h2: its exceptions end here, converted to `Http2ConnectionError` (the connection
must end; a GOAWAY is queued) or to a no-op (a command on a stream the client already closed or
reset: RFC 9113 5.1 forbids most frames on a closed stream, so we never send them).

Before h2 sees a frame, the frames are counted against what h2 does not bound (limits.py), as
on the upstream side: `endpoint.H2Endpoint` holds that accounting for both. On this side it
also counts client resets (rapid reset, CVE-2023-44487). Over a limit the connection ends with
GOAWAY ENHANCE_YOUR_CALM (RFC 9113 7: "the endpoint is ... generating excessive load"). h2
itself enforces the concurrent-stream limit, the frame size, HPACK's decoded header list size
(the HPACK bomb) and the flow-control windows we advertised.

Flow control: a stream's request body is acknowledged (`acknowledge`) only once the adapter has
consumed it, so what the proxy holds never exceeds the windows it advertised (a stream's
`initial_stream_window`, a connection's `connection_window`). What the client does not consume
of a stream that ends (reset, refused) is credited back to the connection window.

A graceful GOAWAY (stream identifiers used up) is written by this module with hyperframe rather
than through h2: h2 closes its state machine on any GOAWAY it sends, after which the open
streams could not finish.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import h2.settings
from hyperframe.frame import GoAwayFrame

from proxycore.errors import Http2ConnectionError
from proxycore.protocol.http2.compact_settings import CompactSettings
from proxycore.protocol.http2.endpoint import H2Endpoint, advertised_settings
from proxycore.protocol.http2.events import (
    ConnectionEnded,
    H2Event,
    RequestReceived,
    StreamReset,
    TrailersReceived,
)
from proxycore.protocol.http2.fields import CONNECTION_SPECIFIC, well_formed
from proxycore.protocol.http2.hpack_out import StatelessEncoder
from proxycore.protocol.http2.limits import H2Limits

__all__ = ["PREFACE", "ErrorCode", "H2Server", "preface_state"]

# RFC 9113 3.4: the client connection preface.
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ErrorCode = h2.errors.ErrorCodes

# Response fields h2 would refuse (after encoding some of them): fields.py, and never TE.
_PSEUDO = frozenset({b":method", b":scheme", b":authority", b":path", b":protocol"})
_CONNECTION_SPECIFIC = CONNECTION_SPECIFIC | {b"te"}


class H2Server(H2Endpoint):
    """One HTTP/2 server connection (see the module docstring)."""

    # The client's resets are rate limited (rapid reset, CVE-2023-44487).
    _COUNT_RESETS = True
    _PEER = "client"

    def __init__(self, limits: H2Limits) -> None:
        config = h2.config.H2Configuration(
            client_side=False,
            header_encoding=None,
            # The request's fields are checked by us (here and in messages.py) so that a
            # malformed request is a stream error answered 400 (RFC 9113 8.1.1), not a
            # connection error that would end its sibling streams, as h2's checks make it.
            validate_inbound_headers=False,
            normalize_inbound_headers=True,
            # Our response heads are checked by `send_headers` before h2 sees them (lowercase
            # token names, clean values, no connection-specific fields, :status first), and
            # encoded by the stateless encoder (hpack_out.py), which never indexes: h2's
            # second pass over every field found nothing and cost a fifth of a response head.
            validate_outbound_headers=False,
            normalize_outbound_headers=False,
        )
        h2c = h2.connection.H2Connection(config)
        h2c.encoder = StatelessEncoder()  # type: ignore[assignment]
        # The settings advertised are the settings enforced (h2 reads local_settings for both):
        # set them before the preface rather than waiting for the client's acknowledgement.
        h2c.remote_settings = CompactSettings(client=True)
        h2c.local_settings = CompactSettings(
            client=False,
            initial_values={
                h2.settings.SettingCodes.MAX_CONCURRENT_STREAMS: limits.max_concurrent_streams,
                **advertised_settings(limits),
                # RFC 8441 3: extended CONNECT (WebSocket over a stream, websocket.py).
                h2.settings.SettingCodes.ENABLE_CONNECT_PROTOCOL: int(limits.extended_connect),
            },
        )
        super().__init__(limits, h2c)
        self._preface_seen = False
        # Streams whose final response head went out.
        self._responded: set[int] = set()
        # After a graceful GOAWAY: the last stream served; higher ones are refused.
        self._last_stream: int | None = None

    # -- starting -------------------------------------------------------------------------------

    def initiate(self) -> None:
        """Queue the server preface: SETTINGS, and the connection window (RFC 9113 6.9.2)."""
        self._started = True
        self._h2.initiate_connection()
        self._open_connection_window()

    def initiate_upgrade(self, settings_header: bytes) -> None:
        """`Upgrade: h2c` (RFC 7540 3.2): stream 1 is the request that asked, half closed; the
        client's preface follows the 101. Raises Http2ConnectionError on a bad HTTP2-Settings."""
        self._started = True
        try:
            self._h2.initiate_upgrade_connection(settings_header)
        except Exception as exc:  # binascii.Error, hyperframe's errors, h2's: unreadable
            raise Http2ConnectionError(
                f"bad HTTP2-Settings: {exc}", error_code=ErrorCode.PROTOCOL_ERROR, rule="h2_upgrade"
            ) from None
        self._open_connection_window()
        self._live.add(1)
        self._unacked[1] = 0

    # -- input ----------------------------------------------------------------------------------

    def receive_data(self, data: bytes, now: float) -> list[H2Event]:
        """Feed bytes from the client; returns what happened. Raises Http2ConnectionError when
        the connection must end (a GOAWAY is queued in data_to_send())."""
        if self.closed:
            return []
        if not self._started:
            self.initiate()
        buffer = self._buffer
        buffer += data
        events: list[H2Event] = []
        if not self._preface_seen:
            if len(buffer) < len(PREFACE):
                if not PREFACE.startswith(bytes(buffer)):
                    self._fail("not an HTTP/2 connection preface", ErrorCode.PROTOCOL_ERROR, "h2")
                return events
            if buffer[: len(PREFACE)] != PREFACE:
                self._fail("not an HTTP/2 connection preface", ErrorCode.PROTOCOL_ERROR, "h2")
            self._preface_seen = True
            self._feed(bytes(buffer[: len(PREFACE)]), events)
            del buffer[: len(PREFACE)]
        self._receive_frames(events, now)
        return events

    def _oversized(self, header: bytes, events: list[H2Event]) -> None:
        # h2 refuses it (FRAME_SIZE_ERROR): feed the header alone, never the payload.
        self._feed(header, events)

    def _rule_of(self, exc: h2.exceptions.ProtocolError) -> str:
        if isinstance(exc, h2.exceptions.TooManyStreamsError):
            return "h2_max_concurrent_streams"
        if isinstance(exc, h2.exceptions.FlowControlError):
            return "h2_flow_control"
        if isinstance(exc, h2.exceptions.FrameTooLargeError):
            return "h2_frame_size"
        return "h2_protocol_error"

    def _convert_own(self, event: h2.events.Event, events: list[H2Event]) -> None:
        if isinstance(event, h2.events.RequestReceived):
            stream_id = event.stream_id
            assert stream_id is not None
            request = self._request(stream_id, event.headers or [], event.stream_ended)
            if request is not None:
                self._live.add(stream_id)
                self._unacked[stream_id] = 0
                events.append(request)
        elif isinstance(event, h2.events.StreamReset):
            stream_id = event.stream_id
            code = int(event.error_code or 0)
            if self._end(stream_id):
                events.append(StreamReset(stream_id, code, by_peer=event.remote_reset))
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closed = True
            events.append(
                ConnectionEnded(int(event.error_code or 0), int(event.last_stream_id or 0))
            )
        elif isinstance(event, h2.events.TrailersReceived) and event.stream_id in self._live:
            # Request trailers (RFC 9113 8.1): relayed to an HTTP/2 upstream
            # (proxycore/protocol/trailers.py); StreamEnded follows.
            fields = tuple(
                (bytes(n), bytes(v)) for n, v in event.headers or [] if bytes(n)[:1] != b":"
            )
            events.append(TrailersReceived(event.stream_id, fields))
        # Informational, priority, ALTSVC, unknown frames and acknowledgements: nothing to do.

    def _request(
        self, stream_id: int, headers: list[tuple[bytes, bytes]], ended: object
    ) -> RequestReceived | None:
        limits = self.limits
        if stream_id > limits.max_stream_id or (
            self._last_stream is not None and stream_id > self._last_stream
        ):
            self._graceful_goaway(self._last_stream or max(self._live, default=0))
            self._reset(stream_id, ErrorCode.REFUSED_STREAM)
            return None
        if stream_id >= limits.max_stream_id - 1 and self._last_stream is None:
            # No client stream identifier is left after this one (RFC 9113 5.1.1): tell the
            # client to open a new connection for its next requests.
            self._graceful_goaway(stream_id)
        pseudo: dict[bytes, bytes] = {}
        regular: list[tuple[bytes, bytes]] = []
        malformed = ""
        for name, value in headers:
            name, value = bytes(name), bytes(value)
            if name[:1] == b":":
                # RFC 9113 8.3: known pseudo-headers, each once, before the regular fields.
                if name not in _PSEUDO or name in pseudo or regular:
                    malformed = malformed or f"pseudo-header {name[:32]!r} not allowed here"
                pseudo[name] = value
            else:
                regular.append((name, value))
        method = pseudo.get(b":method", b"")
        if method == b"CONNECT" and b":protocol" not in pseudo:
            # RFC 9113 8.5: :authority only.
            if b":scheme" in pseudo or b":path" in pseudo or b":authority" not in pseudo:
                malformed = malformed or "CONNECT with :scheme or :path, or without :authority"
        elif not (method and pseudo.get(b":scheme") and pseudo.get(b":path")):
            malformed = malformed or "a request without :method, :scheme or :path"
        if b":protocol" in pseudo and (method != b"CONNECT" or not self.limits.extended_connect):
            # RFC 8441 4: :protocol only on CONNECT, and only once the setting was advertised.
            malformed = malformed or ":protocol without CONNECT or SETTINGS_ENABLE_CONNECT_PROTOCOL"
        authority = pseudo.get(b":authority")
        if authority is None:
            authority = next((v for n, v in regular if n == b"host"), b"")
        return RequestReceived(
            stream_id=stream_id,
            method=method,
            scheme=pseudo.get(b":scheme", b""),
            authority=authority,
            path=pseudo.get(b":path", b""),
            headers=tuple(regular),
            ended=ended is not None,
            protocol=pseudo.get(b":protocol", b""),
            malformed=malformed,
        )

    # -- commands -------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Bytes queued for the client and not yet taken by data_to_send()."""
        return len(self._h2._data_to_send)

    @property
    def live_streams(self) -> int:
        return len(self._live)

    def send_headers(
        self, stream_id: int, status: int, headers: list[tuple[bytes, bytes]], *, end: bool
    ) -> bool:
        """The response head (or an interim 1xx one, RFC 9113 8.1); False when the stream is
        gone or the head is not one the client may receive now (a second final head, an
        interim one after it or with END_STREAM, 101). Fields HTTP/2 forbids are dropped.

        Checked here, before h2: h2 changes the HPACK encoder's state before some of its own
        checks, so a head it refuses would leave the client's decoder out of step for every
        later head on the connection."""
        if stream_id not in self._live or stream_id in self._responded:
            return False
        interim = 100 <= status < 200
        if not 100 <= status <= 999 or status == 101 or (interim and end):
            return False
        fields = [(b":status", b"%d" % status)]
        fields += [
            (n, v) for n, v in headers if n not in _CONNECTION_SPECIFIC and well_formed(n, v)
        ]
        if not self._send(lambda: self._h2.send_headers(stream_id, fields, end_stream=end)):
            return False
        if not interim:
            self._responded.add(stream_id)
        if end:
            self._end(stream_id)
        return True

    def send_data(self, stream_id: int, data: bytes | memoryview, *, end: bool) -> int:
        """Send as much of `data` as the windows allow (one frame); returns the bytes taken.
        `end` ends the stream once all of `data` went. -1: the stream is gone."""
        window = self.send_window(stream_id)
        if stream_id not in self._live or stream_id not in self._responded:
            return -1  # gone, or no final head yet (RFC 9113 8.1: DATA follows it)
        take = min(len(data), window)
        if take == 0 and (data or not end):
            return 0
        last = end and take == len(data)
        chunk = bytes(data[:take])
        if not self._send(lambda: self._h2.send_data(stream_id, chunk, end_stream=last)):
            return -1
        if last:
            self._end(stream_id)
        return take

    def end_stream(self, stream_id: int) -> bool:
        """END_STREAM (an empty DATA frame); False when the stream is gone."""
        if stream_id not in self._live or stream_id not in self._responded:
            return False
        sent = self._send(lambda: self._h2.end_stream(stream_id))
        self._end(stream_id)
        return sent

    def send_trailers(self, stream_id: int, headers: list[tuple[bytes, bytes]]) -> bool:
        """A trailer section ending the response (RFC 9113 8.1); fields HTTP/2 forbids are
        dropped. False when the stream is gone or has no final head yet."""
        if stream_id not in self._live or stream_id not in self._responded:
            return False
        fields = [(n, v) for n, v in headers if n not in _CONNECTION_SPECIFIC and well_formed(n, v)]
        if not self._send(lambda: self._h2.send_headers(stream_id, fields, end_stream=True)):
            return False
        self._end(stream_id)
        return True

    def stop_receiving(self, stream_id: int) -> None:
        """The response is complete and the request body is not wanted: RST_STREAM NO_ERROR
        (RFC 9113 8.1), unless the client already ended its side."""
        stream = self._h2.streams.get(stream_id)
        if stream is not None and not stream.closed:
            self._send(lambda: self._h2.reset_stream(stream_id, ErrorCode.NO_ERROR))
            self._end(stream_id)

    def reset(self, stream_id: int, code: int = ErrorCode.CANCEL) -> None:
        """RST_STREAM (only on a stream that is still open on our side)."""
        if stream_id in self._live:
            self._reset(stream_id, code)

    def goaway(self, code: int = ErrorCode.NO_ERROR) -> None:
        """End the connection: GOAWAY naming the last stream the client opened."""
        if self.closed:
            return
        self.closed = True
        try:
            self._h2.close_connection(code)
        except h2.exceptions.ProtocolError:
            pass

    def graceful_goaway(self) -> None:
        """No new streams (the proxy is stopping, the connection idled): GOAWAY NO_ERROR, the
        open streams finish."""
        if not self.closed and self._last_stream is None:
            self._graceful_goaway(self._h2.highest_inbound_stream_id)

    # -- internals ------------------------------------------------------------------------------

    def _graceful_goaway(self, last_stream_id: int) -> None:
        if self._last_stream is not None or self.closed:
            return
        self._last_stream = last_stream_id
        frame = GoAwayFrame(0)
        frame.last_stream_id = last_stream_id
        frame.error_code = ErrorCode.NO_ERROR
        self._h2._data_to_send += frame.serialize()

    def _reset(self, stream_id: int, code: int) -> None:
        self._send(lambda: self._h2.reset_stream(stream_id, code))
        self._end(stream_id)

    def _end(self, stream_id: int) -> bool:
        self._responded.discard(stream_id)
        return super()._end(stream_id)


def preface_state(buffer: bytes | bytearray) -> bool | None:
    """Whether `buffer` (where an HTTP/1.1 head would start) opens with the HTTP/2 client
    preface (RFC 9113 3.4, prior knowledge): True, False, or None while it is still a prefix."""
    if len(buffer) >= len(PREFACE):
        return buffer[: len(PREFACE)] == PREFACE
    return None if PREFACE.startswith(bytes(buffer)) else False
