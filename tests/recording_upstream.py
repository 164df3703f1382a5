"""A plain-HTTP upstream on loopback that records, byte-exact, what the proxy sends it.

Unlike appliance.demo_upstream (the standard library's lenient server), this one reads every
connection with h11, a strict reader, as the back end behind the proxy would: it records each
complete request (method, target, fields in order, body) and every connection on which h11
refused what it received, and answers each request with 200 and a short body. A test can thus
assert what reached the back end as a request, and that nothing reached it that a strict reader
refuses.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import h11

Fields = list[tuple[bytes, bytes]]


@dataclass
class Seen:
    """One complete request as h11 read it at the upstream."""

    method: bytes
    target: bytes
    headers: Fields
    body: bytes = b""

    def names(self) -> list[bytes]:
        return [name for name, _ in self.headers]


def _no_extra(seen: Seen) -> Fields:
    return []


@dataclass
class RecordingUpstream:
    """Serves on 127.0.0.1 (one thread per connection) until `close`."""

    response_fields: Callable[[Seen], Fields] = _no_extra
    # If set, the whole response as raw bytes (for framings h11 would not send); the
    # connection is closed after it.
    raw_response: Callable[[Seen], bytes] | None = None
    requests: list[Seen] = field(default_factory=list)
    # h11 refused what the proxy sent (malformed), or the proxy closed inside a request.
    errors: list[str] = field(default_factory=list)
    truncated: int = 0
    connections: int = 0

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(512)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def port(self) -> int:
        return int(self._listener.getsockname()[1])

    def clear(self) -> None:
        with self._lock:
            self.requests.clear()
            self.errors.clear()
            self.truncated = 0

    def close(self) -> None:
        self._closed = True
        try:
            # Wake accept(): connect once, then close the listener.
            socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
        except OSError:
            pass
        self._thread.join(timeout=5)
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return
            if self._closed:
                sock.close()
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._serve, args=(sock,), daemon=True).start()

    def _serve(self, sock: socket.socket) -> None:
        conn = h11.Connection(h11.SERVER, max_incomplete_event_size=1 << 20)
        current: Seen | None = None
        eof = False
        sock.settimeout(30)
        try:
            while True:
                event = conn.next_event()
                if event is h11.NEED_DATA:
                    data = sock.recv(65536)
                    eof = not data
                    conn.receive_data(data)
                elif isinstance(event, h11.Request):
                    current = Seen(event.method, event.target, list(event.headers))
                elif isinstance(event, h11.Data):
                    assert current is not None
                    current.body += event.data
                elif isinstance(event, h11.EndOfMessage):
                    assert current is not None
                    with self._lock:
                        self.requests.append(current)
                    if self.raw_response is not None:
                        sock.sendall(self.raw_response(current))
                        return
                    body = b"ok " + current.target
                    headers = [(b"content-length", b"%d" % len(body))]
                    headers += self.response_fields(current)
                    out = conn.send(h11.Response(status_code=200, headers=headers))
                    if current.method != b"HEAD":
                        out += conn.send(h11.Data(data=body))
                    out += conn.send(h11.EndOfMessage())
                    sock.sendall(out)
                    current = None
                    if conn.our_state is not h11.DONE or conn.their_state is not h11.DONE:
                        return
                    conn.start_next_cycle()
                else:  # ConnectionClosed, or anything a plain request never leads to
                    return
        except h11.RemoteProtocolError as exc:
            with self._lock:
                if eof and current is not None:
                    self.truncated += 1
                else:
                    self.errors.append(f"{exc} after {conn.trailing_data[0][:200]!r}")
        except OSError:
            pass
        finally:
            sock.close()
