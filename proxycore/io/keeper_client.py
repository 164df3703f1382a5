"""The proxy worker's side of the keeper channel: forward one keeper call to applianced.

One Unix-socket connection per call (`Connection: close`), one HTTP/1.1 exchange through h11,
everything under one deadline. applianced authenticates the connection by SO_PEERCRED and the
`X-Internal-Token` header; the crew travels in `X-Crew` and is always the crew of the gateway the
agent's connection arrived on (the caller passes `ConnectionTask.crew.name`), never a field of the
agent's body. Failures read as `KeeperUnavailable` (503): the agent gets no credential and no
command runs (fail closed).
"""

from __future__ import annotations

import h11
import trio

from proxycore.errors import ProxyError

# An execute may run for its 120 s limit after the model's answer: the worker waits longer.
FORWARD_TIMEOUT_SECONDS = 180.0
MAX_ANSWER_BYTES = 4 << 20
INTERNAL_PREFIX = "/internal/keeper/"


class KeeperUnavailable(ProxyError):
    """applianced's keeper could not be reached or broke the protocol."""

    status_hint = 503


async def forward_to_keeper(
    socket_path: str,
    token: str,
    action: str,
    crew: str,
    body: bytes,
    *,
    timeout: float = FORWARD_TIMEOUT_SECONDS,
) -> tuple[int, bytes]:
    """(status, JSON body) of applianced's answer; KeeperUnavailable on any failure."""
    client = h11.Connection(h11.CLIENT)
    request = h11.Request(
        method="POST",
        target=INTERNAL_PREFIX + action,
        headers=[
            ("Host", "applianced"),
            ("Content-Type", "application/json"),
            ("Content-Length", str(len(body))),
            ("Connection", "close"),
            ("X-Internal-Token", token),
            ("X-Crew", crew),
        ],
    )
    outgoing = b"".join(
        client.send(event) or b"" for event in (request, h11.Data(data=body), h11.EndOfMessage())
    )
    status = 0
    answer = bytearray()
    try:
        with trio.fail_after(timeout):
            stream = await trio.open_unix_socket(socket_path)
            async with stream:
                await stream.send_all(outgoing)
                while True:
                    event = client.next_event()
                    if event is h11.NEED_DATA:
                        client.receive_data(await stream.receive_some(65536))
                    elif isinstance(event, h11.Response):
                        status = event.status_code
                    elif isinstance(event, h11.Data):
                        answer += event.data
                        if len(answer) > MAX_ANSWER_BYTES:
                            raise KeeperUnavailable("the keeper's answer is too large")
                    elif isinstance(event, h11.EndOfMessage | h11.ConnectionClosed):
                        break
    except trio.TooSlowError:
        raise KeeperUnavailable("the keeper did not answer in time") from None
    except (OSError, trio.BrokenResourceError, h11.ProtocolError) as exc:
        raise KeeperUnavailable(f"the keeper is unreachable ({type(exc).__name__})") from None
    if status == 0:
        raise KeeperUnavailable("the keeper closed the connection without an answer")
    return status, bytes(answer)
