"""A small blocking HTTP/2 client on a raw socket (h2's client side), for tests that need
exact control of the frames: requests, and attacks as raw frames (hyperframe)."""

from __future__ import annotations

import socket
import time
from typing import Any

import h2.config
import h2.connection
import h2.events
from hyperframe.frame import Frame, GoAwayFrame, RstStreamFrame


class H2Client:
    def __init__(self, proxy: Any, *, timeout: float = 10.0) -> None:
        self.proxy = proxy
        self.sock = socket.create_connection((proxy.host, proxy.port), timeout=timeout)
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.h2.initiate_connection()
        self.sock.sendall(self.h2.data_to_send())
        self.authority = f"{proxy.host}:{proxy.port}".encode()

    def __enter__(self) -> H2Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.sock.close()

    def headers(self, path: str, method: bytes = b"GET") -> list[tuple[bytes, bytes]]:
        return [
            (b":method", method),
            (b":scheme", b"http"),
            (b":authority", self.authority),
            (b":path", path.encode()),
        ]

    def get(self, stream_id: int, path: str) -> tuple[int, bytes]:
        self.h2.send_headers(stream_id, self.headers(path), end_stream=True)
        self.sock.sendall(self.h2.data_to_send())
        return self.response(stream_id)

    def response(self, stream_id: int, deadline: float = 10.0) -> tuple[int, bytes]:
        status, body = 0, bytearray()
        end = time.monotonic() + deadline
        while time.monotonic() < end:
            data = self.sock.recv(65536)
            if not data:
                raise ConnectionError("closed")
            for event in self.h2.receive_data(data):
                if isinstance(event, h2.events.ResponseReceived) and event.stream_id == stream_id:
                    status = int(dict(event.headers)[b":status"])
                elif isinstance(event, h2.events.DataReceived) and event.stream_id == stream_id:
                    body += event.data
                    self.h2.acknowledge_received_data(event.flow_controlled_length, stream_id)
                elif isinstance(event, h2.events.StreamEnded) and event.stream_id == stream_id:
                    self.sock.sendall(self.h2.data_to_send())
                    return status, bytes(body)
                elif isinstance(event, h2.events.StreamReset) and event.stream_id == stream_id:
                    raise ConnectionError(f"stream reset: {event.error_code}")
            self.sock.sendall(self.h2.data_to_send())
        raise TimeoutError("no response")

    def send_raw(self, data: bytes) -> None:
        self.sock.sendall(data)

    def frames_until_close(self, timeout: float = 10.0) -> list[Frame]:
        """Read raw frames until the proxy closes the connection."""
        self.sock.settimeout(timeout)
        buffer = bytearray()
        try:
            while True:
                data = self.sock.recv(65536)
                if not data:
                    break
                buffer += data
        except (ConnectionResetError, TimeoutError):
            pass
        return parse_frames(bytes(buffer))


def parse_frames(data: bytes) -> list[Frame]:
    frames = []
    view = memoryview(data)
    while len(view) >= 9:
        frame, length = Frame.parse_frame_header(view[:9])
        if len(view) < 9 + length:
            break
        frame.parse_body(view[9 : 9 + length])
        frames.append(frame)
        view = view[9 + length :]
    return frames


def goaway_code(frames: list[Frame]) -> int | None:
    codes = [f.error_code for f in frames if isinstance(f, GoAwayFrame)]
    return codes[-1] if codes else None


def resets(frames: list[Frame]) -> list[tuple[int, int]]:
    return [(f.stream_id, f.error_code) for f in frames if isinstance(f, RstStreamFrame)]
