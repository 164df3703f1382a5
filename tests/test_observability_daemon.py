"""applianced's logs and metrics through a real crew: a real daemon (JSON logs at debug level),
the real Docker engine (busybox crew), real proxy workers, the TLS fake provider on loopback.
The metrics are read back over the admin socket with Prometheus' own text parser
(prometheus_client.parser) and must move as the traffic says; the log must hold no ERROR, no
traceback and no credential, `run` included."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import time
from collections.abc import Callable

import pytest
from prometheus_client.parser import text_string_to_metric_families

from appliance.demo_upstream import FakeServer
from tests.daemon_support import REACH_TEST_HOSTS, Appliance, busybox_images

pytestmark = pytest.mark.docker

KEY = "sk-ant-api03-OBSERVE-granted-0123456789abcdef"
STORE_KEY = "00112233445566778899aabbccddeeff00112233445566778899aabbccddeeff"
RFC3339_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z")

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(app: Appliance) -> Samples:
    """GET /metrics on the admin socket, parsed by Prometheus' parser."""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(10)
        sock.connect(str(app.socket))
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: applianced\r\nConnection: close\r\n\r\n")
        chunks = []
        while data := sock.recv(65536):
            chunks.append(data)
    head, _, body = b"".join(chunks).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200"), head
    assert b"content-type: text/plain; version=0.0.4" in head.lower(), head
    samples: Samples = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for(app: Appliance, check: Callable[[Samples], bool], what: str) -> Samples:
    """The events reach applianced in batches (a flush interval): scrape until `check` holds."""
    deadline = time.monotonic() + 15
    while True:
        samples = scrape(app)
        if check(samples):
            return samples
        if time.monotonic() > deadline:
            shown = {k: v for k, v in samples.items() if k[0].startswith("appliance_")}
            raise AssertionError(f"{what}: {shown}")
        time.sleep(0.2)


def in_crew(app: Appliance, crew: str, script: str) -> subprocess.CompletedProcess[str]:
    return app.ctl("run", crew, "--", "sh", "-c", script)


def raw_request(app: Appliance, gateway: str, head: str, body: str = "") -> str:
    """A shell line that sends one raw HTTP/1.1 request to the crew's gateway."""
    text = head.replace("\r\n", "\\r\\n") + body
    return f"printf '{text}' | nc -w 30 {gateway} {app.port}"


def json_records(app: Appliance) -> list[dict[str, object]]:
    records = []
    for line in app.log_text().splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            raise AssertionError(f"not one JSON object per line: {line!r}") from None
    return records


def test_metrics_and_logs_follow_real_traffic(
    appliance: Appliance, provider: FakeServer, plain_host: FakeServer
) -> None:
    app = appliance
    app.write_config(*busybox_images(), log_format="json", log_level="debug")
    app.start(env={"ENCRYPTION_KEY": STORE_KEY})
    done = app.ctl_stdin(KEY + "\n", "cred", "add", "claude", "--provider", "anthropic")
    assert done.returncode == 0, done.stderr
    crew = app.crew("obs")
    code, created = app.ctl_json(
        "crew", "create", crew, *REACH_TEST_HOSTS, "--mode", "restricted", "--allow", "plain.test"
    )
    assert code == 0, (created, app.log_text())
    gateway = created["crew"]["gateway"]
    assert app.ctl("cred", "grant", "claude", crew).returncode == 0
    before = scrape(app)
    assert value(before, "appliance_proxy_requests_total", crew=crew, decision="denied") == 0

    # Denied: a host off the allowlist, answered 403.
    denied = in_crew(
        app,
        crew,
        raw_request(
            app,
            gateway,
            f"GET http://other.test:{app.plain_port}/x HTTP/1.1\r\nHost: other.test\r\n"
            "Connection: close\r\n\r\n",
        ),
    )
    assert "403" in denied.stdout, denied
    after = wait_for(
        app,
        lambda s: (
            value(s, "appliance_proxy_requests_total", crew=crew, decision="denied", status="403")
            == 1
        ),
        "one denied request",
    )
    assert (
        value(after, "appliance_proxy_requests_total", crew=crew, decision="allowed", status="200")
        == 0
    )

    # Allowed, forward route: 200, bytes down counted.
    plain = in_crew(app, crew, f"wget -q -O- http://plain.test:{app.plain_port}/size?n=5000")
    assert plain.returncode == 0, plain
    # Allowed, reverse route with the granted key injected; the provider echoes it back, once
    # in a whole body and once in a stream (SSE): both redacted, both counted.
    for leak in ("body", "sse"):
        out = in_crew(
            app,
            crew,
            raw_request(
                app,
                gateway,
                f"POST /anthropic/v1/messages HTTP/1.1\r\nHost: x\r\nx-fake-leak: {leak}\r\n"
                "content-length: 2\r\nConnection: close\r\n\r\n",
                "{}",
            ),
        )
        assert KEY not in out.stdout and "[REDACTED:" in out.stdout, out
    assert provider.last().all("x-api-key") == [KEY]
    after = wait_for(
        app,
        lambda s: (
            value(s, "appliance_proxy_requests_total", crew=crew, decision="allowed", status="200")
            >= 2
            and value(
                s, "appliance_proxy_requests_total", crew=crew, decision="allowed", status="401"
            )
            >= 1
        ),
        "the allowed requests",
    )
    assert (
        value(after, "appliance_proxy_requests_total", crew=crew, decision="denied", status="403")
        == 1
    )
    assert value(after, "appliance_proxy_bytes_total", crew=crew, direction="down") >= 5000
    assert value(after, "appliance_proxy_bytes_total", crew=crew, direction="up") >= 4
    assert value(after, "appliance_proxy_credential_injections_total", crew=crew) == 2
    # body: the key once; sse: at least the whole key in the last event.
    assert value(after, "appliance_scrubber_redactions_total", crew=crew) >= 2
    reverse = value(
        after, "appliance_proxy_request_duration_seconds_count", crew=crew, route="reverse"
    )
    assert reverse == 2
    assert (
        value(
            after,
            "appliance_proxy_request_duration_seconds_bucket",
            crew=crew,
            route="reverse",
            le="+Inf",
        )
        == reverse
    )
    assert (
        value(after, "appliance_proxy_request_duration_seconds_sum", crew=crew, route="reverse") > 0
    )
    assert value(after, "appliance_journal_entries_total", type="credential.changed") >= 1
    assert value(after, "appliance_journal_queue_capacity") > 0

    # A tunnel held open shows as open, then closed.
    tunnel = subprocess.Popen(
        [
            *app.ctl_argv(),
            "run",
            crew,
            "--",
            "sh",
            "-c",
            f"(printf 'CONNECT plain.test:{app.plain_port} HTTP/1.1\\r\\n"
            "Host: plain.test\\r\\n\\r\\n'; "
            f"sleep 4) | nc -w 6 {gateway} {app.port}",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        wait_for(
            app,
            lambda s: value(s, "appliance_proxy_tunnels_open", crew=crew) == 1,
            "one open tunnel",
        )
    finally:
        tunnel.communicate(timeout=30)
    after = wait_for(
        app,
        lambda s: (
            value(s, "appliance_proxy_tunnels_open", crew=crew) == 0
            and value(s, "appliance_proxy_tunnels_opened_total", crew=crew) == 1
        ),
        "the tunnel closed",
    )

    # A worker killed: its restart is counted with the reason.
    _, status = app.ctl_json("status")
    first = status["proxy_workers"][0]
    os.kill(first["pid"], signal.SIGKILL)
    wait_for(
        app,
        lambda s: (
            value(
                s,
                "appliance_proxy_worker_restarts_total",
                worker=str(first["index"]),
                reason="SIGKILL",
            )
            == 1
        ),
        "the restart",
    )

    records = json_records(app)
    for record in records:
        assert RFC3339_UTC.fullmatch(str(record["ts"])), record
        assert {"level", "logger", "msg"} <= record.keys(), record
        assert record["level"] not in ("error", "critical") or "killed by SIGKILL" in str(
            record["msg"]
        ), record
    assert any(r["level"] == "debug" for r in records)
    # The admin requests' records carry their request id and the crew they name.
    assert any(r.get("crew") == crew and r.get("request_id") for r in records), records
    # The workers' records come through applianced, marked with the worker.
    assert any(r["logger"] == "proxycore.worker" and "worker" in r for r in records), records
    text = app.log_text()
    assert "Traceback" not in text and "BrokenPipe" not in text
    assert KEY not in text


def test_run_logs_no_error_in_text_form(appliance: Appliance) -> None:
    """Every `run` used to log an ERROR with a BrokenPipe traceback in applianced."""
    app = appliance
    app.start()
    crew = app.crew("run")
    code, created = app.ctl_json("crew", "create", crew, *REACH_TEST_HOSTS)
    assert code == 0, (created, app.log_text())
    for _ in range(3):
        done = app.ctl("run", crew, "--", "sh", "-c", "echo out; echo err >&2; exit 3")
        assert done.returncode == 3 and done.stdout == "out\n", done
    fast = app.ctl("run", crew, "--", "true")
    assert fast.returncode == 0, fast
    # A client killed while its command runs: one INFO line, and the command is stopped.
    gone = subprocess.Popen(
        [*app.ctl_argv(), "run", crew, "--", "sh", "-c", "echo started; sleep 3; echo done"],
        stdout=subprocess.PIPE,
    )
    assert gone.stdout is not None and gone.stdout.readline() == b"started\n"
    gone.kill()
    gone.wait()
    deadline = time.monotonic() + 20
    while "the admin client went away" not in app.log_text():
        assert time.monotonic() < deadline, app.log_text()
        time.sleep(0.2)
    time.sleep(0.5)
    text = app.log_text()
    assert " ERROR " not in text and "Traceback" not in text and "BrokenPipe" not in text, text
    for line in text.splitlines():
        # "<RFC 3339 time> <LEVEL> <component>: <message> key=value..."
        stamp, level, component = line.split(" ", 3)[:3]
        assert RFC3339_UTC.fullmatch(stamp) and level in {"INFO", "WARNING"}, line
        assert component.endswith(":"), line
