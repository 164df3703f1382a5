"""The log formats, the worker-to-applianced log relay, the scrubber's redaction count and the
metrics' exposition, each on its own (no daemon, no Docker): tests/test_observability_daemon.py
runs them together through a real crew."""

from __future__ import annotations

import io
import json
import logging
import random
import re
from collections.abc import Iterator

import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families

from appliance import logs as alogs
from appliance.daemon.config import ConfigInvalid, metrics_address, parse_config
from appliance.daemon.metrics import DaemonMetrics, Traffic, serve_tcp
from appliance.journal import entries as E
from native.scrub import Scrubber
from proxycore import logs
from proxycore.protocol import events as pe
from proxycore.protocol.scrubbing import MARKER, MarkerCount, redactions

SECRET = "sk-ant-api03-UNIT-observe-0123456789abcdef"
RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")


@pytest.fixture
def captured() -> Iterator[io.StringIO]:
    """The root logger configured as applianced does, into a buffer; restored afterwards."""
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    buffer = io.StringIO()
    yield buffer
    for handler in root.handlers[:]:
        root.removeHandler(handler)
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def test_json_records_carry_time_level_component_and_bound_fields(captured: io.StringIO) -> None:
    logs.configure("json", "debug", stream=captured)
    log = logging.getLogger("applianced.api")
    with logs.bound(crew="demo", request_id="r1"):
        log.debug("line one\nline two")
        with logs.bound(crew=None):  # None leaves the outer value
            log.info("inner", extra={"worker": 3})
    log.warning("outside")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = captured.getvalue().splitlines()
    assert len(lines) == 4  # one line per record, the line break and the traceback included
    records = [json.loads(line) for line in lines]
    for record in records:
        assert RFC3339_UTC.fullmatch(record["ts"]) and record["logger"] == "applianced.api"
    assert records[0] == {**records[0], "level": "debug", "msg": "line one\nline two"}
    assert records[0]["crew"] == "demo" and records[0]["request_id"] == "r1"
    assert records[1]["crew"] == "demo" and records[1]["worker"] == 3
    assert "crew" not in records[2] and "request_id" not in records[2]
    assert records[3]["level"] == "error" and "ValueError: boom" in records[3]["exc"]


def test_text_records_are_one_readable_line(captured: io.StringIO) -> None:
    logs.configure("text", "info", stream=captured)
    log = logging.getLogger("applianced")
    log.debug("below the level")
    with logs.bound(crew="demo"):
        log.info('ready "now"\nforged INFO line', extra={"request_id": "a b"})
    (line,) = captured.getvalue().splitlines()
    stamp, level, rest = line.split(" ", 2)
    assert RFC3339_UTC.fullmatch(stamp) and level == "INFO"
    assert rest == 'applianced: ready "now"\\nforged INFO line crew=demo request_id="a b"'


def test_bad_format_and_level_are_refused() -> None:
    with pytest.raises(ValueError, match="log format"):
        logs.formatter("xml")
    with pytest.raises(ValueError, match="log level"):
        logs.level_number("loud")
    with pytest.raises(ConfigInvalid, match="log_format"):
        parse_config('[daemon]\nlog_format = "xml"\n')
    config = parse_config('[daemon]\nlog_format = "json"\nlog_level = "debug"\n')
    assert (config.daemon.log_format, config.daemon.log_level) == ("json", "debug")


def test_worker_lines_are_logged_again_scrubbed(captured: io.StringIO) -> None:
    """A worker's JSON record comes out as applianced's, in applianced's format, scrubbed after
    decoding (a secret escaped inside the JSON text would not match before)."""
    logs.configure("json", "debug", stream=captured)
    scrubber = Scrubber([("anthropic", SECRET)])
    relay = alogs.WorkerLog(1, 4242, scrubber.scrub_text)
    worker_out = io.StringIO()
    handler = logs.configure("json", "debug", stream=worker_out, fields={"worker": 1})
    logging.getLogger("proxycore.io.connection").warning(
        'upstream said "%s"', SECRET, extra={"crew": "demo"}
    )
    handler.flush()
    logs.configure("json", "debug", stream=captured)
    kept = relay.emit(worker_out.getvalue().strip())
    relay.emit("Fatal Python error: " + SECRET)  # not a record: one WARNING, scrubbed
    relay.emit('{"msg": "x", "logger": "../../etc", "level": "loud"}')
    text = captured.getvalue()
    assert SECRET not in text and SECRET not in kept and "[REDACTED:anthropic]" in kept
    first, second, third = (json.loads(line) for line in text.splitlines())
    assert first["logger"] == "proxycore.io.connection" and first["level"] == "warning"
    assert (first["crew"], first["worker"], first["worker_pid"]) == ("demo", 1, 4242)
    assert second["logger"] == "proxycore.worker" and second["level"] == "warning"
    assert third["logger"] == "proxycore.worker"  # a component name that is not one


def test_worker_level_is_applianced_s_but_never_above_info(captured: io.StringIO) -> None:
    logs.configure("text", "error", stream=captured)
    assert alogs.worker_level() == "info"
    logs.configure("text", "debug", stream=captured)
    assert alogs.worker_level() == "debug"


# -- the scrubber's count ---------------------------------------------------------------------


def test_marker_count_does_not_depend_on_the_cut() -> None:
    rng = random.Random(7)
    text = b"".join(rng.choice([MARKER, b"x", b"[", b"[REDACTED", b"ED:"]) for _ in range(400))
    whole = text.count(MARKER)
    for _ in range(200):
        counter = MarkerCount()
        pos = 0
        while pos < len(text):
            step = rng.choice([1, 2, 3, 9, 10, 11, 50])
            counter.feed(text[pos : pos + step])
            pos += step
        assert counter.count == whole


def test_redactions_count_what_the_scrubber_replaced_not_markers_quoted() -> None:
    scrubber = Scrubber([("anthropic", SECRET)])
    body = f"quoted [REDACTED:x] then {SECRET} and {SECRET}".encode()
    assert redactions(body, scrubber.scrub(body)) == 2
    stream = scrubber.stream()
    markers_in, markers_out = MarkerCount(), MarkerCount()
    for pos in range(0, len(body), 5):
        markers_in.feed(body[pos : pos + 5])
        markers_out.feed(stream.feed(body[pos : pos + 5]))
    markers_out.feed(stream.flush())
    assert markers_out.count - markers_in.count == 2


# -- the metrics ---------------------------------------------------------------------------------


def samples(metrics: DaemonMetrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    body, content_type = metrics.exposition()
    assert content_type.startswith("text/plain; version=0.0.4")
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body.decode())
        for s in family.samples
    }


def allowed(crew: str, status: int, duration: float, **more: int) -> pe.RequestAllowed:
    return pe.RequestAllowed(
        crew=crew,
        mode="restricted",
        route="reverse",
        method="POST",
        host="api.anthropic.com",
        port=443,
        address="1.2.3.4",
        rule="provider",
        status=status,
        bytes_up=more.get("up", 0),
        bytes_down=more.get("down", 0),
        duration=duration,
        redactions=more.get("redactions", 0),
    )


def test_traffic_counts_from_the_events_and_forgets_removed_crews() -> None:
    crews = {"a", "b"}
    traffic = Traffic(crews=lambda: crews)
    metrics = DaemonMetrics(traffic=traffic)
    traffic.proxy_events(
        0,
        [
            allowed("a", 200, 0.02, up=10, down=100, redactions=2),
            allowed("a", 200, 3.0, down=5),
            pe.RequestDenied(
                crew="a",
                mode="restricted",
                route="forward",
                method="GET",
                host="x.test",
                port=80,
                rule="allowlist",
                status=403,
            ),
            pe.TunnelOpened(crew="b", tunnel_id=1, host="h.test", port=443, address="1.2.3.4"),
            allowed("stranger", 502, 0.1),
            None,
        ],
    )
    got = samples(metrics)
    assert (
        got[
            (
                "appliance_proxy_requests_total",
                (("crew", "a"), ("decision", "allowed"), ("status", "200")),
            )
        ]
        == 2
    )
    assert (
        got[
            (
                "appliance_proxy_requests_total",
                (("crew", "a"), ("decision", "denied"), ("status", "403")),
            )
        ]
        == 1
    )
    assert (
        got[
            (
                "appliance_proxy_requests_total",
                (("crew", "_other"), ("decision", "allowed"), ("status", "502")),
            )
        ]
        == 1
    )
    assert got[("appliance_proxy_bytes_total", (("crew", "a"), ("direction", "down")))] == 105
    assert got[("appliance_scrubber_redactions_total", (("crew", "a"),))] == 2
    assert got[("appliance_proxy_tunnels_open", (("crew", "b"),))] == 1
    assert got[("appliance_proxy_events_unreadable_total", ())] == 1
    bucket = "appliance_proxy_request_duration_seconds_bucket"
    assert got[(bucket, (("crew", "a"), ("le", "0.025"), ("route", "reverse")))] == 1
    assert got[(bucket, (("crew", "a"), ("le", "5.0"), ("route", "reverse")))] == 2
    assert got[
        ("appliance_proxy_request_duration_seconds_sum", (("crew", "a"), ("route", "reverse")))
    ] == pytest.approx(3.02)
    # The worker dies: its tunnels are gone with it, and the restart is counted.
    traffic.entry_submitted(
        E.ProxyWorkerExited(
            worker=0,
            pid=9,
            reason="killed",
            exit_code=None,
            signal="SIGKILL",
            killed_by=None,
            uptime=1.0,
            restarts=1,
            restart_in=0.2,
        )
    )
    crews.discard("a")
    got = samples(metrics)
    assert (
        got[("appliance_proxy_worker_restarts_total", (("reason", "SIGKILL"), ("worker", "0")))]
        == 1
    )
    assert got[("appliance_proxy_tunnels_opened_total", (("crew", "b"),))] == 1
    assert not any(labels and ("crew", "a") in labels for _, labels in got)


def test_metrics_address_parsing() -> None:
    assert metrics_address("127.0.0.1:9464") == ("127.0.0.1", 9464)
    assert metrics_address("[::1]:9464") == ("::1", 9464)
    for bad in ("localhost:9464", "127.0.0.1", "127.0.0.1:0", "1.2.3.4:99999"):
        with pytest.raises(ValueError):
            metrics_address(bad)
    with pytest.raises(ConfigInvalid, match=r"metrics\.listen"):
        parse_config('[metrics]\nlisten = "localhost:1"\n')


async def test_the_tcp_listener_serves_get_metrics_only() -> None:
    metrics = DaemonMetrics(traffic=Traffic())
    async with trio.open_nursery() as nursery:
        port = await nursery.start(serve_tcp, metrics, "127.0.0.1", 0)

        async def get(path: str) -> bytes:
            stream = await trio.open_tcp_stream("127.0.0.1", port)
            async with stream:
                await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                out = b""
                while data := await stream.receive_some(65536):
                    out += data
            return out

        answer = await get("/metrics")
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200")
        names = {f.name for f in text_string_to_metric_families(body.decode())}
        assert {"appliance_proxy_requests", "process_resident_memory_bytes"} <= names
        assert (await get("/v1/crews")).startswith(b"HTTP/1.1 404")
        nursery.cancel_scope.cancel()
