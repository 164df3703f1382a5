"""The chaos suite's "internet": every hostile and ordinary peer, in one process, in a namespace.

Run by tests/chaos_support.py as `ip netns exec PEER python tests/chaos_peers.py ADDRESS LOG`;
it listens on ADDRESS only (the peer namespace's own address), prints one line "ready" when
every port is bound, and stops when its standard input closes (the test's end) or after
MAX_LIFETIME seconds, whichever comes first, so a lost test cannot leave it behind for long.

Theory of operation: one asyncio loop serves every port. Each HTTP peer reads a request head and
its body (Content-Length or chunked) and then behaves as its port says:

| port           | behaviour                                                                  |
|----------------|----------------------------------------------------------------------------|
| OK (8080)      | an ordinary keep-alive origin: /ok, /bytes/N, /chunked/N, /slow/N          |
| RESET (8081)   | resets (SO_LINGER 0) before answering, after a head, or mid-chunked body   |
| BADCHUNK (8082)| malformed response framing: bad chunk sizes, missing CRLF, truncation      |
| SILENT (8083)  | raw: accepts, reads, never answers, holds the connection after an EOF      |
| ECHO (8084)    | raw bytes echoed back; half-closes when the client does (tunnel target)    |
| FIREHOSE (8085)| raw: after the first bytes in, sends data until the socket breaks (bounded) |
| TUNNEL_RESET   | raw: echoes the first bytes in, then resets (8086)                         |
| MANY_BASE + i  | MANY ordinary origins (fd exhaustion through distinct host:port pairs)     |
| DNS (5353/udp) | names under B_ZONE answered (A = ADDRESS), under A_ZONE never answered     |

Every request head an HTTP peer receives is appended to LOG as "PORT METHOD TARGET": the
smuggling test reads it to prove a request hidden in a refused body never reached a peer. DNS
questions are logged as "dns QNAME answered|ignored|nxdomain".
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import struct
import sys

OK = 8080
RESET = 8081
BADCHUNK = 8082
SILENT = 8083
ECHO = 8084
FIREHOSE = 8085
TUNNEL_RESET = 8086
MANY_BASE = 20000
MANY = 700
DNS = 5353
A_ZONE = "a.chaos.test."  # crew A's names: the server never answers them
B_ZONE = "b.chaos.test."  # crew B's names: answered at once
MAX_LIFETIME = 600.0
SILENT_HOLD = 30.0
FIREHOSE_BYTES = 256 * 1024 * 1024
MAX_HEAD = 64 * 1024

_log_file = None


def log(line: str) -> None:
    assert _log_file is not None
    _log_file.write(line + "\n")
    _log_file.flush()


def reset(writer: asyncio.StreamWriter) -> None:
    """Close with SO_LINGER 0: the kernel sends RST instead of FIN."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


class Request:
    def __init__(self, method: str, target: str, headers: dict[str, str]) -> None:
        self.method = method
        self.target = target
        self.headers = headers

    @property
    def close(self) -> bool:
        return self.headers.get("connection", "").lower() == "close"


async def read_request(reader: asyncio.StreamReader, port: int) -> Request | None:
    """One request head and its body (discarded); None at a clean EOF between requests."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    except asyncio.LimitOverrunError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ")
    if len(parts) != 3:
        return None
    headers = {}
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name:
            headers[name.strip().lower()] = value.strip()
    request = Request(parts[0], parts[1], headers)
    log(f"{port} {request.method} {request.target}")
    if headers.get("transfer-encoding", "").lower() == "chunked":
        while True:
            size = int((await reader.readuntil(b"\r\n")).split(b";")[0], 16)
            if size == 0:
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                break
            await reader.readexactly(size + 2)
    else:
        remaining = int(headers.get("content-length", "0"))
        while remaining:
            data = await reader.read(min(remaining, 1 << 20))
            if not data:
                raise asyncio.IncompleteReadError(b"", remaining)
            remaining -= len(data)
    return request


def head(status: int, fields: list[tuple[str, str]], close: bool = False) -> bytes:
    lines = [f"HTTP/1.1 {status} X"] + [f"{n}: {v}" for n, v in fields]
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _size(target: str) -> int:
    return min(int(target.rsplit("/", 1)[1].split("?")[0]), 1 << 30)


async def ok_origin(request: Request, writer: asyncio.StreamWriter) -> bool:
    """An ordinary origin; returns whether the connection stays open."""
    path = request.target.split("?")[0]
    if "://" in path:
        path = "/" + path.split("://", 1)[1].split("/", 1)[-1]
    close = request.close
    if path.startswith("/bytes/"):
        size = _size(path)
        writer.write(head(200, [("content-length", str(size))], close))
        block = b"x" * 65536
        sent = 0
        while sent < size:
            piece = block[: size - sent]
            writer.write(piece)
            sent += len(piece)
            await writer.drain()
    elif path.startswith("/chunked/") or path.startswith("/slow/"):
        size = _size(path)
        slow = path.startswith("/slow/")
        writer.write(head(200, [("transfer-encoding", "chunked")], close))
        sent = 0
        while sent < size:
            piece = min(16384, size - sent)
            writer.write(b"%x\r\n%s\r\n" % (piece, b"y" * piece))
            sent += piece
            await writer.drain()
            if slow:
                await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
    else:
        body = b"ok\n"
        writer.write(head(200, [("content-length", str(len(body)))], close) + body)
    await writer.drain()
    return not close


async def http_peer(port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            request = await read_request(reader, port)
            if request is None:
                break
            if port == RESET:
                await reset_peer(request, writer)
                return
            if port == BADCHUNK:
                await badchunk_peer(request, writer)
                return
            if not await ok_origin(request, writer):
                break
    except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError):
        pass
    finally:
        writer.close()


async def reset_peer(request: Request, writer: asyncio.StreamWriter) -> None:
    if request.target.endswith("/before"):
        pass  # reset before any byte of a response
    elif request.target.endswith("/after-head"):
        # A large Content-Length (streamed by the proxy), 64 KiB of it, then RST.
        writer.write(head(200, [("content-length", str(1 << 20))]) + b"r" * 65536)
        await writer.drain()
        await asyncio.sleep(0.05)
    elif request.target.endswith("/mid-chunked"):
        writer.write(head(200, [("transfer-encoding", "chunked")]))
        for _ in range(4):
            writer.write(b"4000\r\n" + b"c" * 0x4000 + b"\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)
    elif request.target.endswith("/short-body"):
        # A small Content-Length (read whole by the proxy) cut short by a reset.
        writer.write(head(200, [("content-length", "1000")]) + b"s" * 10)
        await writer.drain()
        await asyncio.sleep(0.05)
    reset(writer)


BAD_FRAMINGS = {
    # name: (response bytes sent at once, whether a complete head precedes the error)
    "early": head(200, [("transfer-encoding", "chunked")]) + b"zz\r\nhello\r\n0\r\n\r\n",
    "overflow": head(200, [("transfer-encoding", "chunked")]) + b"f" * 40 + b"\r\nhello\r\n",
    "negative": head(200, [("transfer-encoding", "chunked")]) + b"-5\r\nhello\r\n0\r\n\r\n",
    "no-crlf": head(200, [("transfer-encoding", "chunked")]) + b"5\r\nhelloXX0\r\n\r\n",
    "dual": head(200, [("content-length", "5"), ("transfer-encoding", "chunked")])
    + b"5\r\nhello\r\n0\r\n\r\n",
    "bad-length": head(200, [("content-length", "12x")]) + b"hello",
    "two-lengths": head(200, [("content-length", "5"), ("content-length", "7")]) + b"hello",
}


async def badchunk_peer(request: Request, writer: asyncio.StreamWriter) -> None:
    name = request.target.rsplit("/", 1)[1]
    if name == "late" or name == "late-truncated":
        # A valid first chunk (the proxy may relay it and the head), then the fault.
        writer.write(head(200, [("transfer-encoding", "chunked")]) + b"5\r\nhello\r\n")
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.write(b"nothex\r\n" if name == "late" else b"100\r\nabc")
    else:
        # Head and fault in one write: they reach the proxy together, before it sent anything.
        writer.write(BAD_FRAMINGS[name])
    await writer.drain()
    await asyncio.sleep(0.2)


async def silent_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Reads whatever comes, never answers; after an EOF the connection is held open still
    (a half-open peer), for SILENT_HOLD seconds."""
    try:
        while await reader.read(65536):
            pass
        await asyncio.sleep(SILENT_HOLD)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def echo_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()
        writer.write_eof()
        await writer.drain()
        await asyncio.sleep(0.05)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


async def firehose_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    block = b"f" * (1 << 18)
    try:
        if not await reader.read(65536):
            return
        sent = 0
        while sent < FIREHOSE_BYTES:
            writer.write(block)
            sent += len(block)
            await writer.drain()
    except (ConnectionError, OSError):
        pass
    finally:
        writer.transport.abort()


async def tunnel_reset_peer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        data = await reader.read(65536)
        if data:
            writer.write(data)
            await writer.drain()
            await asyncio.sleep(0.05)
    except (ConnectionError, OSError):
        pass
    reset(writer)


class DnsPeer(asyncio.DatagramProtocol):
    def __init__(self, address: str) -> None:
        self.address = address
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        import dns.message
        import dns.rcode
        import dns.rdatatype
        import dns.rrset

        try:
            query = dns.message.from_wire(data)
            question = query.question[0]
        except Exception:
            return
        name = question.name.to_text().lower()
        if name.endswith(A_ZONE):
            log(f"dns {name} ignored")
            return  # never answered: the resolver waits until its own timeout
        response = dns.message.make_response(query)
        if name.endswith(B_ZONE) and question.rdtype == dns.rdatatype.A:
            response.answer.append(dns.rrset.from_text(question.name, 60, "IN", "A", self.address))
            log(f"dns {name} answered")
        elif name.endswith(B_ZONE):
            log(f"dns {name} empty")  # NOERROR, no records (AAAA and the like)
        else:
            response.set_rcode(dns.rcode.NXDOMAIN)
            log(f"dns {name} nxdomain")
        assert self.transport is not None
        self.transport.sendto(response.to_wire(), addr)


async def main(address: str) -> None:
    loop = asyncio.get_running_loop()
    servers = []

    def http(port: int):  # type: ignore[no-untyped-def]
        return lambda r, w: http_peer(port, r, w)

    for port in (OK, RESET, BADCHUNK):
        servers.append(await asyncio.start_server(http(port), address, port, limit=MAX_HEAD))
    servers.append(await asyncio.start_server(silent_peer, address, SILENT))
    servers.append(await asyncio.start_server(echo_peer, address, ECHO))
    servers.append(await asyncio.start_server(firehose_peer, address, FIREHOSE))
    servers.append(await asyncio.start_server(tunnel_reset_peer, address, TUNNEL_RESET))
    for index in range(MANY):
        port = MANY_BASE + index
        servers.append(await asyncio.start_server(http(port), address, port, backlog=16))
    await loop.create_datagram_endpoint(lambda: DnsPeer(address), local_addr=(address, DNS))
    print("ready", flush=True)
    stdin_closed = loop.create_future()

    def on_stdin() -> None:
        if not sys.stdin.buffer.read1(4096) and not stdin_closed.done():
            stdin_closed.set_result(None)

    loop.add_reader(sys.stdin.fileno(), on_stdin)
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(stdin_closed, MAX_LIFETIME)
    # Done: leave at once, rather than have asyncio cancel (and report) every open handler.
    assert _log_file is not None
    _log_file.close()
    os._exit(0)


if __name__ == "__main__":
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    _log_file = open(sys.argv[2], "a")  # noqa: SIM115
    asyncio.run(main(sys.argv[1]))
