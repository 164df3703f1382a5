"""The proxy as applianced's child: crews added and removed over the control socketpair, each with
a listening socket bound by the parent and passed down (SCM_RIGHTS). Real proxy process."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import msgspec

from appliance.demo_upstream import FakeServer
from proxycore import control
from tests.conftest import REAL_KEYS, free_port, proxy_env, write_proxy_config


def request(channel: socket.socket, message: object, listener: socket.socket | None = None) -> dict:
    data = msgspec.json.encode(message) + b"\n"
    if listener is not None:
        import array

        fds = array.array("i", [listener.fileno()]).tobytes()
        channel.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)])
    else:
        channel.sendall(data)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = channel.recv(65536)
        assert chunk, "the proxy closed its channel"
        reply += chunk
    return dict(json.loads(reply))


def curl(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["curl", "-sS", "--noproxy", "", "--max-time", "10", *args],
        capture_output=True,
        text=True,
        timeout=20,
    )


def listening(address: str, port: int) -> socket.socket:
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((address, port))
    sock.listen(16)
    return sock


def test_crew_added_and_removed_over_the_channel(
    tmp_path: Path, provider: FakeServer, ca_file: str
) -> None:
    port = free_port()
    config, _, _ = write_proxy_config(
        tmp_path, port=port, provider_port=provider.port, ca_file=ca_file, gateway="127.0.0.9"
    )
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "proxycore.worker",
            "--config",
            str(config),
            "--control-fd",
            str(theirs.fileno()),
        ],
        env=proxy_env(),
        pass_fds=[theirs.fileno()],
        stderr=subprocess.PIPE,
    )
    theirs.close()
    try:
        ours.settimeout(10)
        assert request(ours, control.Ping()) == {"ok": True}
        gateway = "127.0.0.23"
        listener = listening(gateway, port)
        reply = request(
            ours,
            control.CrewAdd(
                name="alpha",
                gateway=gateway,
                mode="restricted",
                listener=True,
                ssrf_allow=("127.0.0.0/8",),
            ),
            listener,
        )
        listener.close()  # the proxy holds its own copy now
        assert reply == {"ok": True, "changed": True}
        provider.clear()
        done = curl(f"http://{gateway}:{port}/anthropic/v1/models")
        assert done.returncode == 0, done.stderr
        assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]
        health = curl(f"http://{gateway}:{port}/health")
        assert json.loads(health.stdout)["crew"] == "alpha"

        # A duplicate name or gateway is refused, and its listener is not adopted.
        again = listening("127.0.0.24", port)
        dup = request(
            ours,
            control.CrewAdd(
                name="alpha", gateway="127.0.0.24", listener=True, ssrf_allow=("127.0.0.0/8",)
            ),
            again,
        )
        again.close()
        assert not dup["ok"] and "already served" in dup["error"]
        assert curl(f"http://127.0.0.24:{port}/health").returncode != 0
        bad = request(ours, control.CrewAdd(name="bad name", gateway="127.0.0.25"))
        assert not bad["ok"] and "crew[0].name" in bad["error"]
        # A message that promises a listener and brings none is refused.
        missing = request(
            ours,
            control.CrewAdd(
                name="beta", gateway="127.0.0.26", listener=True, ssrf_allow=("127.0.0.0/8",)
            ),
        )
        assert not missing["ok"] and "no listening socket" in missing["error"]

        assert request(ours, control.CrewRemove(name="alpha")) == {"ok": True, "changed": True}
        assert request(ours, control.CrewRemove(name="alpha")) == {"ok": True}
        refused = curl(f"http://{gateway}:{port}/health")
        assert refused.returncode != 0  # the listener is closed: connection refused
        # The port is free again for a new crew on the same gateway.
        listening(gateway, port).close()
    finally:
        ours.close()  # the parent goes away: the proxy stops by itself
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stderr is not None
        stderr = process.stderr.read().decode()
    assert process.returncode == 0, stderr
    assert "control channel closed" in stderr
