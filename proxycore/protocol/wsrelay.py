"""The WebSocket frame relay between an agent and its upstream, without I/O (RFC 6455 5 to 7).

Theory of operation
-------------------
After a checked 101 (proxycore/protocol/websocket.py) the proxy is a WebSocket server to the
agent and a client to the upstream: one wsproto `Connection` per side parses what that side
sends and frames what it is sent (wsproto, from the python-hyper project, is wrapped here and
nowhere else; its exceptions never leave this module). The adapter (proxycore/io/websocket.py)
feeds each side's bytes in with `receive(side, data)` and sends what `take(side)` returns; it
works on any byte stream, so the same relay can later run over an HTTP/2 stream (RFC 8441).

Messages are relayed as they arrive, never assembled: each piece of a data frame that a read
delivers goes out at once as one fragment of the same message. RFC 6455 5.4 lets an
intermediary change the fragmentation of a message that uses no extension (none is negotiated,
see websocket.py). So what one read brings in is all one direction holds, and the adapter reads
no more from a side until the other has taken what it was sent (backpressure).

Upstream to agent, every data message (text and binary, as every HTTP response body) passes
through one scrubber stream per message (proxycore/protocol/scrubbing.py): a secret split across
frames is still found, since the stream holds back what could begin one. A redaction changes
lengths, which re-framing absorbs. Text is re-decoded as UTF-8 after scrubbing, a sequence cut
by a fragment boundary held back until it is whole (wsproto frames text from `str`).

Limits (`WebSocketLimits`): a message over `max_message_bytes` fails its sender with 1009;
control frames (ping, pong) and empty fragments past `control_per_second` fail their sender with
1008; control frames over 125 bytes, bad UTF-8, bad opcodes and unmasked agent frames are
refused by wsproto (1002, 1007). Pings and pongs are relayed end to end.

Closing (RFC 6455 7): a Close from one side is relayed to the other, and the other's Close in
answer is relayed back, which completes both handshakes (`ended` "complete"). A side that fails
(a protocol error, a limit, its connection lost without a Close) is sent a Close if it can
still take one and is read no more; the other side is sent 1001 and its answer awaited. The
adapter bounds that wait (`close_timeout`) and the silence of a session (`idle_timeout`):
`expire_idle()` starts a close with both sides, `expire_close()` ends what remains.
"""

from __future__ import annotations

import codecs
import dataclasses
import enum

from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Ping, Pong, TextMessage
from wsproto.frame_protocol import CloseReason
from wsproto.utilities import LocalProtocolError

from native.scrub import Scrubber, ScrubStream
from proxycore.errors import ProxyError
from proxycore.protocol.scrubbing import MarkerCount

__all__ = ["Side", "WebSocketLimits", "WebSocketProtocolError", "WebSocketRelay"]

# RFC 6455 7.4.1 status codes the relay sends itself.
NORMAL = 1000
GOING_AWAY = 1001
POLICY_VIOLATION = 1008
MESSAGE_TOO_BIG = 1009
NO_STATUS = 1005  # "no code was sent": relayed as a Close without a code
# RFC 6455 5.5: a control frame's payload is at most 125 bytes; a Close reason 123 of them.
MAX_REASON_BYTES = 123


class WebSocketProtocolError(ProxyError):
    """The relay was driven against its state (a bug of the caller): the only error that
    leaves this module. What a peer sends never raises; it ends that peer's side."""


class Side(enum.Enum):
    AGENT = "agent"
    UPSTREAM = "upstream"

    @property
    def other(self) -> Side:
        return Side.UPSTREAM if self is Side.AGENT else Side.AGENT


@dataclasses.dataclass(frozen=True, slots=True)
class WebSocketLimits:
    max_message_bytes: int = 16 * 1024 * 1024
    control_per_second: int = 100
    idle_timeout: float = 300.0
    close_timeout: float = 5.0


class _Peer:
    """One side: its wsproto connection, what it sent, and the message it is in."""

    __slots__ = (
        "bytes",
        "close_sent",
        "conn",
        "control",
        "decoder",
        "done",
        "frames",
        "lost",
        "message_bytes",
        "messages",
        "outgoing",
        "scrub",
        "window",
    )

    def __init__(self, kind: ConnectionType) -> None:
        self.conn = Connection(kind)
        self.outgoing = bytearray()  # bytes to send to this side
        self.done = False  # read no more from this side
        self.close_sent = False  # a Close was queued for this side
        self.lost = False  # its connection failed (`WebSocketRelay.lost`)
        self.bytes = 0  # payload bytes this side sent (the agent's as sent, before scrubbing)
        self.frames = 0
        self.messages = 0
        self.message_bytes = 0  # of the message this side is in the middle of
        self.control = 0  # control frames and empty fragments in the current window
        self.window = 0.0
        # Upstream messages only: the scrubber stream and the UTF-8 decoder of a text message.
        self.scrub: ScrubStream | None = None
        self.decoder: codecs.IncrementalDecoder | None = None


class WebSocketRelay:
    """Both sides of one relayed WebSocket session (see the module docstring)."""

    def __init__(self, scrubber: Scrubber, limits: WebSocketLimits) -> None:
        self.scrubber = scrubber
        self.limits = limits
        self.peers = {
            Side.AGENT: _Peer(ConnectionType.SERVER),
            Side.UPSTREAM: _Peer(ConnectionType.CLIENT),
        }
        # Why the session ended: "complete" (a clean close handshake), else the first cause.
        self.ended = ""
        self.closed_by = ""  # "agent", "upstream" or "proxy": whose Close (or failure) began it
        self.close_code = 0
        # A Close has been sent to a side that has yet to answer: the adapter bounds the wait.
        self.closing = False
        self.bytes_down = 0  # payload bytes sent to the agent, after scrubbing
        self.markers = (MarkerCount(), MarkerCount())  # in, out: their difference: redactions

    # -- what the adapter asks -----------------------------------------------------------------

    @property
    def done(self) -> bool:
        """Nothing more to relay: both sides are finished (the adapter closes them)."""
        return all(_finished(peer) for peer in self.peers.values())

    def wants_input(self, side: Side) -> bool:
        return not self.peers[side].done and not self.done

    def pending(self, side: Side) -> bool:
        return bool(self.peers[side].outgoing)

    def take(self, side: Side) -> bytes:
        """What to send to `side` now (the adapter sends it before reading more)."""
        peer = self.peers[side]
        out = bytes(peer.outgoing)
        peer.outgoing.clear()
        return out

    @property
    def redactions(self) -> int:
        return max(0, self.markers[1].count - self.markers[0].count)

    def closed_in_order(self, side: Side) -> bool:
        """`side` was sent a Close, and everything for it was taken, and its connection did not
        fail: its transport may end in order (a FIN; on an HTTP/2 stream END_STREAM, RFC 8441
        5), rather than be reset."""
        peer = self.peers[side]
        return peer.close_sent and not peer.lost and not peer.outgoing

    def stats(self, side: Side) -> tuple[int, int, int]:
        """(payload bytes, frames, messages) that `side` sent."""
        peer = self.peers[side]
        return peer.bytes, peer.frames, peer.messages

    # -- input ------------------------------------------------------------------------------

    def receive(self, side: Side, data: bytes, now: float) -> None:
        """Bytes from `side`; b"" is its end of stream. Never raises for what a peer sends."""
        peer = self.peers[side]
        if peer.done:
            return  # after its Close, its failure or its end: ignored
        try:
            if not data:
                peer.conn.receive_data(None)
                peer.done = True
                self._lost(side, f"{side.value}_closed", side.value)
                return
            peer.conn.receive_data(data)
            for event in peer.conn.events():
                self._on_event(side, event, now)
                if peer.done:
                    break
        except LocalProtocolError as exc:
            raise WebSocketProtocolError(f"websocket relay ({side.value}): {exc}") from None

    def lost(self, side: Side, why: str) -> None:
        """`side`'s connection failed (a reset, a broken pipe): it is read and sent no more."""
        peer = self.peers[side]
        peer.outgoing.clear()
        peer.lost = True
        if peer.conn.state is not ConnectionState.CLOSED:
            peer.conn.receive_data(None)
        peer.done = True
        self._lost(side, why, side.value)

    def expire_idle(self) -> None:
        """Nothing moved for `idle_timeout`: close with both sides (1001)."""
        self.go_away("idle_timeout", "idle timeout")

    def go_away(self, why: str, reason: str = "") -> None:
        """The proxy ends the session (a deadline, the crew removed, the worker stopping):
        a Close (1001) to each side that can take one, an answer to each that is owed one."""
        self._note_end(why, "proxy", GOING_AWAY)
        for side in Side:
            self._send_close(side, GOING_AWAY, reason)

    def expire_close(self) -> None:
        """A side did not answer a Close within `close_timeout`: answer what is owed, stop."""
        self._note_end("close_timeout", "proxy", GOING_AWAY)
        for side, peer in self.peers.items():
            if peer.conn.state is ConnectionState.REMOTE_CLOSING:
                self._send_close(side, GOING_AWAY, "")
            peer.done = True
            if peer.conn.state is not ConnectionState.CLOSED:
                peer.conn.receive_data(None)  # the connection is given up: CLOSED
        self.closing = False

    # -- events -----------------------------------------------------------------------------

    def _on_event(self, side: Side, event: Event, now: float) -> None:
        peer = self.peers[side]
        if isinstance(event, TextMessage | BytesMessage):
            self._on_data(side, event, now)
        elif isinstance(event, Ping | Pong):
            peer.frames += 1
            if self._flooding(side, now):
                return
            target = self.peers[side.other]
            if target.conn.state is ConnectionState.OPEN:
                # Relayed end to end: a ping answers for the far peer, not for the proxy.
                target.outgoing += target.conn.send(
                    Ping(bytes(event.payload))
                    if isinstance(event, Ping)
                    else Pong(bytes(event.payload))
                )
        else:
            assert isinstance(event, CloseConnection)
            state = peer.conn.state
            if state in (ConnectionState.REMOTE_CLOSING, ConnectionState.CLOSED):
                peer.frames += 1
                peer.done = True
                self._on_close(side, event.code, event.reason or "")
            else:
                # wsproto reports a frame it could not parse as a Close it did not receive
                # (its state unchanged): RFC 6455 7.1.7, fail this side.
                self._fail(side, event.code, f"{side.value}_protocol_error: {event.reason}")

    def _on_data(self, side: Side, event: TextMessage | BytesMessage, now: float) -> None:
        peer = self.peers[side]
        if event.frame_finished:
            peer.frames += 1
        text = isinstance(event, TextMessage)
        data = event.data
        payload = data.encode("utf-8") if isinstance(data, str) else bytes(data)
        finished = event.message_finished
        if not payload and not finished and event.frame_finished and self._flooding(side, now):
            return
        peer.bytes += len(payload)
        peer.message_bytes += len(payload)
        if peer.message_bytes > self.limits.max_message_bytes:
            self._fail(
                side,
                MESSAGE_TOO_BIG,
                f"message_too_big: over {self.limits.max_message_bytes} bytes",
            )
            return
        if finished:
            peer.messages += 1
            peer.message_bytes = 0
        target = self.peers[side.other]
        if target.conn.state is not ConnectionState.OPEN:
            # The other side sent a Close (or was sent one): it takes no more data frames
            # (RFC 6455 5.5.1); what is still on its way to it is dropped.
            peer.scrub = peer.decoder = None
            return
        if side is Side.UPSTREAM:
            payload = self._scrubbed(peer, payload, text, finished)
            self.bytes_down += len(payload)
            if text:
                decoder = peer.decoder
                assert decoder is not None
                data = decoder.decode(payload, finished)
                if finished:
                    peer.decoder = None
            else:
                data = payload
        if not data and not finished:
            return  # nothing to say yet (an empty piece, or the first bytes of a character)
        if text:
            assert isinstance(data, str)
            target.outgoing += target.conn.send(TextMessage(data, message_finished=finished))
        else:
            assert not isinstance(data, str)
            message = BytesMessage(bytes(data), message_finished=finished)
            target.outgoing += target.conn.send(message)

    def _scrubbed(self, peer: _Peer, payload: bytes, text: bool, finished: bool) -> bytes:
        """One piece of an upstream message through the message's scrubber stream."""
        if peer.scrub is None:
            peer.scrub = self.scrubber.stream()
            if text:
                # RFC 6455 5.6: the message as a whole is UTF-8; a fragment need not be, and a
                # redaction next to a multi-byte sequence could leave bytes that are not:
                # replaced, never relayed as invalid text.
                peer.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.markers[0].feed(payload)
        out = peer.scrub.feed(payload) if payload else b""
        if finished:
            out += peer.scrub.flush()
            peer.scrub = None
        self.markers[1].feed(out)
        return out

    def _flooding(self, side: Side, now: float) -> bool:
        """Control frames and empty fragments over `control_per_second`: fail the side (1008).
        They are relayed under backpressure anyway; this bounds what they cost the worker."""
        peer = self.peers[side]
        if now - peer.window >= 1.0:
            peer.window = now
            peer.control = 0
        peer.control += 1
        if peer.control <= self.limits.control_per_second:
            return False
        self._fail(side, POLICY_VIOLATION, "control_flood: too many control frames")
        return True

    # -- closing ----------------------------------------------------------------------------

    def _on_close(self, side: Side, code: int, reason: str) -> None:
        """`side` sent a Close: relay it, or, if it answers one, complete the other's."""
        target = self.peers[side.other]
        if side is Side.UPSTREAM:
            reason = self._scrub_reason(reason)
        state = target.conn.state
        if state is ConnectionState.OPEN:
            self._note_end("", side.value, code)
            self._send_close(side.other, code, reason)
        elif state is ConnectionState.REMOTE_CLOSING:
            # The other side began the close; this is the answer: complete its handshake.
            self._send_close(side.other, code, reason)
            self._note_end("complete", "", 0)
        elif state is ConnectionState.LOCAL_CLOSING:
            self._note_end("", side.value, code)
        if self.done:
            self.closing = False
            if not self.ended:
                self.ended = "complete"

    def _fail(self, side: Side, code: int, why: str) -> None:
        """RFC 6455 7.1.7: send `side` a Close (if it can take one) and read it no more; the
        other side is told the session is going away."""
        peer = self.peers[side]
        self._note_end(why, "proxy", code)
        peer.done = True
        self._send_close(side, code, why.split(":", 1)[0])
        self._lost(side, why, "proxy")

    def _lost(self, side: Side, why: str, by: str) -> None:
        """`side` is gone: close with the other side, unless that already happened."""
        self._note_end(why, by, GOING_AWAY)
        other = side.other
        target = self.peers[other]
        if target.conn.state in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            self._send_close(other, GOING_AWAY, f"{side.value} connection ended")
        if self.done:
            self.closing = False

    def _send_close(self, side: Side, code: int, reason: str) -> None:
        peer = self.peers[side]
        state = peer.conn.state
        if state not in (ConnectionState.OPEN, ConnectionState.REMOTE_CLOSING):
            return
        if code == NO_STATUS:
            # wsproto writes a Close without a code only for this very member.
            peer.outgoing += peer.conn.send(CloseConnection(code=CloseReason.NO_STATUS_RCVD))
        else:
            peer.outgoing += peer.conn.send(CloseConnection(code=code, reason=reason or None))
        peer.close_sent = True
        if state is ConnectionState.OPEN and not peer.done:
            self.closing = True  # its answer is awaited

    def _note_end(self, why: str, by: str, code: int) -> None:
        """The first cause of the end wins; a clean answer to a Close makes it "complete"."""
        if why == "complete":
            if not self.ended:
                self.ended = "complete"
            return
        if not self.closed_by and by:
            self.closed_by = by
            self.close_code = code
        if why and (not self.ended or self.ended == "complete"):
            self.ended = why

    def _scrub_reason(self, reason: str) -> str:
        """A Close reason from the upstream, scrubbed and kept within 123 bytes of UTF-8."""
        if not reason:
            return reason
        raw = self.scrubber.scrub(reason.encode("utf-8"))
        return raw[:MAX_REASON_BYTES].decode("utf-8", "ignore")


def _finished(peer: _Peer) -> bool:
    """A side is finished once it is read no more and owes no Close answer we wait for."""
    state = peer.conn.state
    if state is ConnectionState.CLOSED:
        return True
    # We sent a Close to a side that failed: RFC 6455 7.1.7, its answer is not awaited.
    return peer.done and state is not ConnectionState.REMOTE_CLOSING
