"""A small blocking HTTP/2 client that speaks WebSocket over streams (RFC 8441 extended CONNECT).

No mainstream Python client speaks RFC 8441 (websockets, aiohttp, httpx-ws: HTTP/1.1 only), so
this one is built from the same pieces a real one would be: the `h2` package's client state
machine for the connection (many streams: WebSocket sessions next to ordinary requests) and
wsproto's frame layer for each session. It honours flow control unless told not to
(`auto_ack=False`: the agent that stops reading), and can send anything raw.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import h2.config
import h2.connection
import h2.events
import h2.exceptions
import h2.settings
from wsproto.connection import Connection, ConnectionState, ConnectionType
from wsproto.events import BytesMessage, CloseConnection, Event, Message, TextMessage


@dataclass
class StreamState:
    status: int = 0
    headers: dict[bytes, bytes] = field(default_factory=dict)
    data: bytearray = field(default_factory=bytearray)
    unacked: int = 0  # flow-controlled bytes received and not acknowledged
    ended: bool = False
    reset: int | None = None  # the error code of the proxy's RST_STREAM

    @property
    def over(self) -> bool:
        return self.ended or self.reset is not None


class H2WsClient:
    def __init__(self, proxy: Any, *, timeout: float = 10.0, auto_ack: bool = True) -> None:
        self.sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(
                client_side=True, header_encoding=None, validate_outbound_headers=False
            )
        )
        self.h2.initiate_connection()
        self.sock.sendall(self.h2.data_to_send())
        self.authority = f"{proxy.host}:{proxy.port}".encode()
        self.streams: dict[int, StreamState] = {}
        self.auto_ack = auto_ack
        self.closed = False
        self.settings: dict[int, int] = {}

    def __enter__(self) -> H2WsClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    # -- the connection -------------------------------------------------------------------------

    def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self, timeout: float = 0.2) -> None:
        """Read once (at most `timeout`) and handle what arrived."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(65536)
        except TimeoutError:
            return
        finally:
            self.sock.settimeout(10.0)
        if not data:
            self.closed = True
            return
        for event in self.h2.receive_data(data):
            self._on(event)
        self.flush()

    def _on(self, event: h2.events.Event) -> None:
        sid = getattr(event, "stream_id", None)
        state = self.streams.setdefault(sid, StreamState()) if sid else None
        if isinstance(event, h2.events.RemoteSettingsChanged):
            for code, setting in event.changed_settings.items():
                self.settings[int(code)] = setting.new_value
        elif isinstance(event, h2.events.ResponseReceived):
            assert state is not None
            state.headers = dict(event.headers)
            state.status = int(state.headers[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            assert state is not None
            state.data += event.data
            state.unacked += event.flow_controlled_length
            if self.auto_ack:
                self.ack(sid)
        elif isinstance(event, h2.events.StreamEnded):
            assert state is not None
            state.ended = True
        elif isinstance(event, h2.events.StreamReset):
            assert state is not None
            state.reset = int(event.error_code)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.closed = True

    def ack(self, sid: int | None) -> None:
        state = self.streams.get(sid) if sid else None
        if state is not None and state.unacked:
            try:
                self.h2.acknowledge_received_data(state.unacked, sid)
            except h2.exceptions.StreamClosedError:
                pass
            state.unacked = 0

    def wait(self, condition: Callable[[], bool], timeout: float = 10.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            if self.closed:
                raise ConnectionError(f"the proxy closed the connection waiting for {what}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited {timeout} s for {what}")
            self.pump()

    # -- streams --------------------------------------------------------------------------------

    def request(
        self, sid: int, headers: list[tuple[bytes, bytes]], *, end: bool = False
    ) -> StreamState:
        state = self.streams.setdefault(sid, StreamState())
        self.h2.send_headers(sid, headers, end_stream=end)
        self.flush()
        return state

    def get(self, sid: int, path: str, authority: bytes | None = None) -> StreamState:
        state = self.request(
            sid,
            [
                (b":method", b"GET"),
                (b":scheme", b"http"),
                (b":authority", authority or self.authority),
                (b":path", path.encode()),
            ],
            end=True,
        )
        return state

    def send_data(self, sid: int, data: bytes, *, end: bool = False) -> None:
        """Send within the proxy's windows (reading meanwhile as they open)."""
        view = memoryview(data)
        while True:
            window = min(self.h2.local_flow_control_window(sid), self.h2.max_outbound_frame_size)
            take = min(window, len(view))
            if take or not view:
                last = end and take == len(view)
                self.h2.send_data(sid, bytes(view[:take]), end_stream=last)
                self.flush()
                view = view[take:]
                if not view:
                    return
            else:
                self.pump()
                if self.streams.get(sid, StreamState()).over:
                    raise ConnectionError(f"stream {sid} is over")

    def end(self, sid: int) -> None:
        self.h2.end_stream(sid)
        self.flush()

    def reset(self, sid: int, code: int = 8) -> None:
        self.h2.reset_stream(sid, code)
        self.flush()

    def websocket(
        self,
        sid: int,
        path: str = "/",
        authority: bytes | None = None,
        *,
        protocol: bytes = b"websocket",
        extra: list[tuple[bytes, bytes]] | None = None,
        version: bytes | None = b"13",
        scheme: bytes = b"http",
    ) -> H2WebSocket:
        headers = [
            (b":method", b"CONNECT"),
            (b":protocol", protocol),
            (b":scheme", scheme),
            (b":authority", authority or self.authority),
            (b":path", path.encode()),
        ]
        if version is not None:
            headers.append((b"sec-websocket-version", version))
        headers += extra or []
        self.request(sid, headers)
        return H2WebSocket(self, sid)


class H2WebSocket:
    """One WebSocket session on a stream: wsproto frames carried in its DATA frames."""

    def __init__(self, client: H2WsClient, sid: int) -> None:
        self.client = client
        self.sid = sid
        self.state = client.streams[sid]
        self.ws = Connection(ConnectionType.CLIENT)
        self.taken = 0  # bytes of the stream's data fed to wsproto
        self.events: list[Event] = []

    def accepted(self, timeout: float = 10.0) -> int:
        """Wait for the response head; its status."""
        self.client.wait(lambda: bool(self.state.status) or self.state.over, timeout, "the 200")
        return self.state.status

    def send(self, event: Event) -> None:
        self.client.send_data(self.sid, self.ws.send(event))

    def _feed(self) -> None:
        data = self.state.data
        if len(data) > self.taken:
            self.ws.receive_data(bytes(data[self.taken :]))
            self.taken = len(data)
            self.events += list(self.ws.events())
        if self.state.over and self.ws.state is not ConnectionState.CLOSED:
            self.ws.receive_data(None)
            self.events += list(self.ws.events())

    def next_event(self, timeout: float = 10.0) -> Event:
        def ready() -> bool:
            self._feed()
            return bool(self.events) or (self.state.over and not self.events)

        self.client.wait(ready, timeout, "a websocket event")
        if not self.events:
            raise ConnectionError(f"stream {self.sid} over (reset {self.state.reset})")
        return self.events.pop(0)

    def message(self, timeout: float = 10.0) -> str | bytes:
        """The next whole message (control frames other than Close skipped)."""
        parts: list[Any] = []
        while True:
            event = self.next_event(timeout)
            if isinstance(event, CloseConnection):
                raise ConnectionError(f"closed: {event.code} {event.reason}")
            if isinstance(event, Message):
                parts.append(event.data)
                if event.message_finished:
                    if isinstance(event, TextMessage):
                        return "".join(parts)
                    assert isinstance(event, BytesMessage)
                    return b"".join(parts)

    def close_event(self, timeout: float = 10.0) -> CloseConnection:
        """Skip messages until the peer's Close."""
        while True:
            event = self.next_event(timeout)
            if isinstance(event, CloseConnection):
                return event

    def wait_over(self, timeout: float = 10.0) -> StreamState:
        self.client.wait(lambda: self.state.over, timeout, "the stream's end")
        return self.state
