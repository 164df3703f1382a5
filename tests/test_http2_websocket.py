"""RFC 8441 extended CONNECT, sans-IO: the setting, the request checks of the h2 wrapper, and the
HTTP/1.1 handshake a stream's extended CONNECT is written as (proxycore/protocol/http2/
websocket.py). The real session is in tests/test_proxy_websocket_h2.py."""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events
import pytest
from hyperframe.frame import SettingsFrame

from proxycore.protocol import http1, http2
from proxycore.protocol.http2 import H2Limits, H2Server, RequestReceived
from proxycore.protocol.http2.websocket import is_extended_connect, websocket_head
from proxycore.protocol.websocket import wants_websocket

NOW = 1000.0
KEY = b"dGhlIHNhbXBsZSBub25jZQ=="
GATEWAY = "10.0.0.1"


def extended(
    authority: bytes = b"example.test:8080",
    path: bytes = b"/chat?room=1",
    protocol: bytes = b"websocket",
    headers: tuple[tuple[bytes, bytes], ...] = ((b"sec-websocket-version", b"13"),),
    scheme: bytes = b"http",
) -> RequestReceived:
    return RequestReceived(
        1, b"CONNECT", scheme, authority, path, headers, False, protocol=protocol
    )


def exchange_reads(head: bytes) -> http1.RequestHead:
    parsed = http1.parse_request_head(head, http1.Limits())
    assert parsed is not None and parsed[1] == len(head)
    return parsed[0]


def test_the_handshake_is_an_http1_upgrade_with_the_proxys_key() -> None:
    request = extended(
        headers=(
            (b"sec-websocket-version", b"13"),
            (b"sec-websocket-protocol", b"chat, superchat"),
            (b"origin", b"http://example.test"),
            (b"sec-websocket-key", b"agent-sent-one"),  # RFC 8441 5: not used; dropped
            (b"sec-websocket-extensions", b"permessage-deflate"),
        )
    )
    assert is_extended_connect(request)
    head = exchange_reads(websocket_head(request, GATEWAY, KEY))
    assert head.method == b"GET" and head.target == b"http://example.test:8080/chat?room=1"
    assert wants_websocket(head) and not head.keep_alive  # one exchange per stream
    fields = dict(head.headers)
    assert fields[b"sec-websocket-key"] == KEY
    assert [v for n, v in head.headers if n == b"sec-websocket-key"] == [KEY]
    assert fields[b"sec-websocket-protocol"] == b"chat, superchat"
    assert fields[b"host"] == b"example.test:8080"
    assert head.body_kind is http1.BodyKind.NONE


def test_a_handshake_to_the_gateway_is_origin_form() -> None:
    head = exchange_reads(
        websocket_head(extended(b"10.0.0.1:9119", b"/openai/realtime"), GATEWAY, KEY)
    )
    assert head.target == b"/openai/realtime"


@pytest.mark.parametrize(
    ("request_", "status", "words"),
    [
        (extended(protocol=b"webtransport"), 501, "webtransport"),
        (extended(protocol=b"connect-udp"), 501, "only websocket"),
        (extended(authority=b""), 400, ":authority"),
        (extended(path=b"no-slash"), 400, ":path"),
        (extended(scheme=b"ftp"), 400, ":scheme"),
        (extended(headers=((b"upgrade", b"websocket"),)), 400, "connection-specific"),
        (extended(headers=((b"x-a", b"1\r\nx-b: 2"),)), 400, "forbids"),
    ],
)
def test_refusals(request_: RequestReceived, status: int, words: str) -> None:
    with pytest.raises(http2.MessageRefused) as caught:
        websocket_head(request_, GATEWAY, KEY)
    assert caught.value.status == status and words in caught.value.message


def client() -> h2.connection.H2Connection:
    c = h2.connection.H2Connection(
        h2.config.H2Configuration(
            client_side=True, header_encoding=None, validate_outbound_headers=False
        )
    )
    c.initiate_connection()
    return c


def handshake(server: H2Server, c: h2.connection.H2Connection) -> dict[int, int]:
    server.receive_data(c.data_to_send(), NOW)
    settings: dict[int, int] = {}
    for event in c.receive_data(server.data_to_send()):
        if isinstance(event, h2.events.RemoteSettingsChanged):
            settings = {int(k): v.new_value for k, v in event.changed_settings.items()}
    server.receive_data(c.data_to_send(), NOW)
    return settings


def request(
    server: H2Server, c: h2.connection.H2Connection, headers: list[tuple[bytes, bytes]]
) -> RequestReceived:
    c.send_headers(1, headers)
    [event] = [e for e in server.receive_data(c.data_to_send(), NOW)]
    assert isinstance(event, RequestReceived)
    return event


CONNECT = [
    (b":method", b"CONNECT"),
    (b":protocol", b"websocket"),
    (b":scheme", b"http"),
    (b":authority", b"example.test"),
    (b":path", b"/"),
]


def test_the_setting_is_advertised_and_extended_connect_reported() -> None:
    server, c = H2Server(H2Limits()), client()
    settings = handshake(server, c)
    assert settings[SettingsFrame.ENABLE_CONNECT_PROTOCOL] == 1
    event = request(server, c, CONNECT)
    assert is_extended_connect(event) and event.protocol == b"websocket"
    assert not event.malformed and not event.ended


def test_protocol_without_the_setting_or_on_another_method_is_malformed() -> None:
    server, c = H2Server(H2Limits(extended_connect=False)), client()
    assert handshake(server, c)[SettingsFrame.ENABLE_CONNECT_PROTOCOL] == 0
    assert "SETTINGS_ENABLE_CONNECT_PROTOCOL" in request(server, c, CONNECT).malformed
    server, c = H2Server(H2Limits()), client()
    handshake(server, c)
    on_get = [(b":method", b"GET"), *CONNECT[1:]]
    event = request(server, c, on_get)
    assert ":protocol" in event.malformed
    with pytest.raises(http2.MessageRefused) as caught:
        http2.request_head(event, GATEWAY)
    assert caught.value.status == 400
