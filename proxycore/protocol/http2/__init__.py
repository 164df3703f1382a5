"""HTTP/2, sans-IO: our own protocol core, for the agent side and the upstream side.

`connection.H2Server` (the agent side) and `client.H2Client` (the upstream side) share the core
in `endpoint.H2Endpoint` (frames: `frames`); they report our own events (`events`) and enforce
the connection's limits (`limits.H2Limits`, docs/proxy.md "HTTP/2"). `messages` turns a stream's
request into the HTTP/1.1 head the exchange reads, and a response head back.
"""

from __future__ import annotations

from proxycore.protocol.http2.client import H2Client, RequestUnsendable
from proxycore.protocol.http2.connection import PREFACE, ErrorCode, H2Server, preface_state
from proxycore.protocol.http2.events import (
    ConnectionEnded,
    DataReceived,
    H2Event,
    PingReceived,
    RequestReceived,
    ResponseReceived,
    SettingsReceived,
    StreamEnded,
    StreamReset,
    TrailersReceived,
    WindowOpened,
)
from proxycore.protocol.http2.limits import H2Limits
from proxycore.protocol.http2.messages import MessageRefused, request_head, response_fields

__all__ = [
    "PREFACE",
    "ConnectionEnded",
    "DataReceived",
    "ErrorCode",
    "H2Client",
    "H2Event",
    "H2Limits",
    "H2Server",
    "MessageRefused",
    "PingReceived",
    "RequestReceived",
    "RequestUnsendable",
    "ResponseReceived",
    "SettingsReceived",
    "StreamEnded",
    "StreamReset",
    "TrailersReceived",
    "WindowOpened",
    "preface_state",
    "request_head",
    "response_fields",
]
