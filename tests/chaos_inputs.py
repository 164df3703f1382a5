"""Crew A's malformed and hostile input: JSON at the keeper, refused requests that hide a
request in their body, odd authorities, and upstreams with malformed framing (driven by
tests/test_chaos.py, with the machinery of tests/chaos_attacks.py)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import trio

from tests import chaos_peers as peers
from tests.chaos_attacks import MARGIN, OK_URL, Attack, connect, expect_cut, get
from tests.chaos_support import LIMITS, PEER_NAME

# --- JSON at the keeper -------------------------------------------------------------------------


def keeper_bodies() -> list[tuple[str, bytes, set[int]]]:
    """(name, body, the statuses that are a correct answer)."""
    deep_list = b"[" * 1024 + b"]" * 1024  # about 1 KiB: enough to kill the proxy today
    deep_intent = b'{"intent": ' + b"[" * 6000 + b"]" * 6000 + b"}"
    deep_objects = b'{"a":' * 2500 + b"1" + b"}" * 2500
    deep_string_keys = b'{"intent": "x", "credential": ' + b'{"k":' * 2000 + b"0" + b"}" * 2001
    wide = b'{"intent": "x", ' + b", ".join(b'"k%d": [%d]' % (i, i) for i in range(1500)) + b"}"
    huge = b"[" + b"1," * (1 << 20) + b"1]"
    return [
        ("1 KiB nested list", deep_list, {400}),
        ("nested intent", deep_intent, {400}),
        ("nested objects", deep_objects, {400}),
        ("nested credential", deep_string_keys, {400}),
        ("wide object", wide, {400, 413, 503}),
        ("2 MiB array", huge, {413}),
    ]


async def keeper_json(attack: Attack, rounds: int = 2) -> None:
    async def post(label: str, path: str, body: bytes, statuses: set[int], chunked: bool) -> None:
        stream, reader = await attack.connect()
        if chunked:
            framing = "Transfer-Encoding: chunked"
            payload = b"".join(
                b"%x\r\n%s\r\n" % (len(body[i : i + 8192]), body[i : i + 8192])
                for i in range(0, len(body), 8192)
            )
            payload += b"0\r\n\r\n"
        else:
            framing = f"Content-Length: {len(body)}"
            payload = body
        head = (
            f"POST {path} HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"{framing}\r\n\r\n"
        ).encode()
        if not await attack.send_request(stream, head):
            return
        async with trio.open_nursery() as nursery:
            # The body is sent alongside: a proxy that refuses early (413) may stop reading.
            async def send_body() -> None:
                try:
                    await stream.send_all(payload)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    pass

            nursery.start_soon(send_body)
            response = await reader.response(10)
            nursery.cancel_scope.cancel()
        attack.expect_refusal(label, response, statuses)
        await stream.aclose()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for i in range(rounds):
        for path in ("/keeper/request", "/keeper/execute"):
            for name, body, statuses in keeper_bodies():
                for chunked in (False, True):
                    label = f"{path} {name}{' chunked' if chunked else ''} {i}"
                    jobs.append(
                        (
                            label,
                            lambda label=label, p=path, b=body, s=statuses, c=chunked: post(
                                label, p, b, s, c
                            ),
                        )
                    )
    await attack.run(jobs, concurrency=16)


# --- refused requests with bodies (smuggling) ---------------------------------------------------


def smuggling_cases(tag: str) -> list[tuple[str, bytes, int]]:
    """(name, the refused request with its body, the refusal's status). Every body holds a
    whole request for the peer, which must never receive it."""
    hidden = get(f"{OK_URL}/smuggled-{tag}")
    big = hidden + b"p" * (256 * 1024) + hidden

    def with_length(start: str, body: bytes, extra: str = "") -> bytes:
        return f"{start}\r\n{extra}Content-Length: {len(body)}\r\n\r\n".encode() + body

    def chunked(start: str, body: bytes) -> bytes:
        return (
            f"{start}\r\nTransfer-Encoding: chunked\r\n\r\n".encode()
            + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
        )

    denied = "POST http://denied.chaos.test/ HTTP/1.1\r\nHost: denied.chaos.test"
    return [
        ("denied host", with_length(denied, hidden), 403),
        ("denied host, chunked", chunked(denied, hidden), 403),
        ("denied host, 100-continue", with_length(denied, hidden, "Expect: 100-continue\r\n"), 403),
        ("denied host, 256 KiB", with_length(denied, big), 403),
        ("no such route", with_length("POST /nowhere HTTP/1.1\r\nHost: gateway", hidden), 404),
        (
            "keeper GET",
            with_length("GET /keeper/request HTTP/1.1\r\nHost: gateway", hidden),
            405,
        ),
        (
            "https target",
            with_length(f"POST https://{PEER_NAME}/ HTTP/1.1\r\nHost: {PEER_NAME}", hidden),
            400,
        ),
        (
            "denied PUT, hidden CONNECT",
            with_length(
                "PUT http://denied.chaos.test/ HTTP/1.1\r\nHost: denied.chaos.test",
                connect(f"{PEER_NAME}:{peers.ECHO}"),
            ),
            403,
        ),
    ]


async def refused_with_bodies(attack: Attack, tag: str, rounds: int = 12) -> None:
    """Bursts of refused requests whose bodies hide a request, each followed on the same
    connection by an ordinary one. Allowed answers: the refusal, then either the ordinary
    request's 200 (the body was drained) or the end of the connection (it was closed); never
    an answer to the hidden request."""

    async def one(label: str, request: bytes, status: int, index: int) -> None:
        stream, reader = await attack.connect()
        after = get(f"{OK_URL}/after-{tag}-{index}", close=True)
        try:
            await stream.send_all(request + after)
        except (trio.BrokenResourceError, trio.ClosedResourceError):
            pass
        responses = []
        while (response := await reader.response(8)) is not None:
            responses.append(response)
        attack.requests += len(responses)  # the requests the proxy read and answered
        if not responses:
            attack.problem(label, "closed without a response")
        else:
            attack.expect_refusal(label, responses[0], {status})
            rest = [r.status for r in responses[1:]]
            if rest not in ([], [200]):
                attack.problem(label, f"after the refusal, answers {rest}: the body was parsed")
        await stream.aclose()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    index = 0
    for i in range(rounds):
        for name, request, status in smuggling_cases(tag):
            label = f"{name} {i}"
            jobs.append(
                (label, lambda label=label, r=request, s=status, n=index: one(label, r, s, n))
            )
            index += 1
    await attack.run(jobs)


# --- CONNECT and absolute-form authorities ------------------------------------------------------


def odd_authorities(peer_address: str) -> list[tuple[str, bytes]]:
    port = peers.ECHO
    names = [
        ("trailing dot", f"{PEER_NAME}.:{port}"),
        ("userinfo", f"evil.test@{PEER_NAME}:{port}"),
        ("userinfo with password", f"user:pw@{PEER_NAME}:{port}"),
        ("zone id, encoded", "[fe80::1%25eth0]:443"),
        ("zone id", "[fe80::1%eth0]:443"),
        ("bracketed loopback", "[::1]:443"),
        ("bracketed IPv4", f"[{peer_address}]:{port}"),
        ("bracketed name", f"[{PEER_NAME}]:{port}"),
        ("unclosed bracket", "[::1:443"),
        ("percent-encoded dots", f"peer%2echaos%2etest:{port}"),
        ("percent-encoded name", "%70%65%65%72.chaos.test:8084"),
        ("huge port", f"{PEER_NAME}:{'9' * 40}"),
        ("port 65536", f"{PEER_NAME}:65536"),
        ("port zero", f"{PEER_NAME}:0"),
        ("empty port", f"{PEER_NAME}:"),
        ("missing port", PEER_NAME),
        ("missing host", f":{port}"),
        ("leading zero port", f"{PEER_NAME}:0{port}"),
        ("signed port", f"{PEER_NAME}:+{port}"),
        ("negative port", f"{PEER_NAME}:-1"),
        ("two ports", f"{PEER_NAME}:{port}:{port}"),
        ("long label", f"{'a' * 300}.test:443"),
        ("huge host", f"{'h.' * 2000}test:443"),
        ("absolute URI", f"http://{PEER_NAME}:{port}"),
        ("path", "/"),
        ("asterisk", "*"),
        ("backslash", f"{PEER_NAME}\\@evil.test:{port}"),
        ("unicode escape", f"{PEER_NAME}\\u0000:{port}"),
    ]
    cases = [(name, authority.encode()) for name, authority in names]
    cases += [
        ("non-ASCII bytes", f"pe\u00e9r.chaos.test:{port}".encode()),
        ("raw UTF-8 homoglyph", f"p\u0435er.chaos.test:{port}".encode()),
        ("NUL", f"peer\x00.chaos.test:{port}".encode()),
        ("DEL", f"peer\x7f.chaos.test:{port}".encode()),
        ("latin-1 byte", b"peer\xff.chaos.test:8084"),
    ]
    return cases


FORWARD_FORMS = (
    "trailing dot",
    "userinfo",
    "zone id, encoded",
    "percent-encoded dots",
    "huge port",
    "port zero",
    "non-ASCII bytes",
    "NUL",
    "latin-1 byte",
)


async def odd_connects(attack: Attack, peer_address: str) -> None:
    async def one(label: str, request: bytes) -> None:
        stream, reader = await attack.connect()
        if await attack.send_request(stream, request):
            response = await reader.response(5)
            attack.expect_refusal(label, response, {400, 403})
        await stream.aclose()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for name, authority in odd_authorities(peer_address):
        request = b"CONNECT %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (authority, authority)
        jobs.append((f"CONNECT {name}", lambda n=name, r=request: one(f"CONNECT {n}", r)))
        if name in FORWARD_FORMS:
            request = b"GET http://%s/ HTTP/1.1\r\nHost: %s\r\n\r\n" % (authority, authority)
            jobs.append((f"GET {name}", lambda n=name, r=request: one(f"GET {n}", r)))
    await attack.run(jobs)


# --- malformed upstream framing -----------------------------------------------------------------


async def bad_upstream_framing(attack: Attack, rounds: int = 3) -> list[str]:
    """Every malformed framing of tests/chaos_peers.py; returns the names sent (in order)."""
    early = list(peers.BAD_FRAMINGS)
    late = ["late", "late-truncated"]

    async def one(label: str, name: str) -> None:
        stream, reader = await attack.connect()
        url = f"http://{PEER_NAME}:{peers.BADCHUNK}/{name}"
        if not await attack.send_request(stream, get(url)):
            return
        response = await reader.response(LIMITS["read_timeout"] + MARGIN)
        if name in early:
            # The head and the fault arrived together, before anything was relayed.
            attack.expect_refusal(label, response, {502})
        else:
            expect_cut(attack, label, response, reader)
        await stream.aclose()

    jobs: list[tuple[str, Callable[[], Awaitable[None]]]] = []
    for i in range(rounds):
        for name in early + late:
            jobs.append((f"{name} {i}", lambda n=name, i=i: one(f"{n} {i}", n)))
    await attack.run(jobs)
    return early + late
