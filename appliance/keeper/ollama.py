"""The trio adapter of the gatekeeper client: one connection per query, under one deadline.

Fail-closed: no model configured, a refused or reset connection, the deadline, a bad reply all
come back as a DENY verdict (appliance/keeper/gatekeeper.py); nothing raises to the caller but
cancellation from outside.
"""

from __future__ import annotations

import trio

from appliance.keeper.gatekeeper import (
    AnswerReader,
    GatekeeperConfig,
    GatekeeperConfigError,
    KeeperQuery,
    Verdict,
    deny,
    encode_chat_request,
)

_READ_SIZE = 65536


async def ask_gatekeeper(config: GatekeeperConfig, query: KeeperQuery) -> Verdict:
    """Ask the configured model once (never cached); DENY on every failure."""
    if config.model is None:
        return deny("no gatekeeper model is configured")
    try:
        host, port, _ = config.endpoint()
        request = encode_chat_request(config, query)
    except GatekeeperConfigError as exc:
        return deny(f"the gatekeeper is misconfigured: {exc}")
    with trio.move_on_after(config.timeout_seconds):
        try:
            return await _exchange(host, port, request)
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            return deny(f"the gatekeeper model is unreachable ({type(exc).__name__})")
    return deny(f"the gatekeeper model did not answer within {config.timeout_seconds:g} s")


async def _exchange(host: str, port: int, request: bytes) -> Verdict:
    stream = await trio.open_tcp_stream(host, port)
    async with stream:
        await stream.send_all(request)
        reader = AnswerReader()
        while reader.verdict is None:
            reader.receive_data(await stream.receive_some(_READ_SIZE))
        return reader.verdict
