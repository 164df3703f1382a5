"""Per-crew provider credentials over the proxy's control socketpair (`credentials_set`): the crew
with a store credential gets it injected, another crew keeps the configured one, a rotation is
used by the very next request and learned by the scrubber, a revocation falls back. Real proxy
process, real TLS fake provider on loopback; the proxy is not dumpable and holds no value in its
argv or environment."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from appliance.demo_upstream import FakeServer
from proxycore import control
from tests.conftest import REAL_KEYS, free_port, proxy_env, write_proxy_config
from tests.test_daemon_proxy_channel import curl, listening, request

KEY_ONE = "sk-ant-api03-STORE-one-crew-alpha-0123456789"
KEY_TWO = "sk-ant-api03-STORE-two-crew-alpha-9876543210"


def core_limit(pid: int) -> tuple[str, str]:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max core file size"):
            soft, hard = line.split()[4:6]
            return soft, hard
    raise AssertionError("no core limit line")


def test_forbid_core_dumps() -> None:
    code = (
        "from proxycore.privileges import forbid_core_dumps, is_dumpable\n"
        "import resource\n"
        "assert is_dumpable()\n"
        "forbid_core_dumps()\n"
        "assert not is_dumpable()\n"
        "assert resource.getrlimit(resource.RLIMIT_CORE) == (0, 0)\n"
        "print('ok')\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=proxy_env(), timeout=30
    )
    assert done.stdout.strip() == "ok", done.stderr


def leak(gateway: str, port: int) -> subprocess.CompletedProcess[str]:
    """A request whose upstream echoes the key it received into the response body."""
    return curl(
        "-X",
        "POST",
        "-H",
        "x-fake-leak: body",
        "--data",
        "{}",
        f"http://{gateway}:{port}/anthropic/v1/messages",
    )


def reflect(gateway: str, port: int, text: str) -> str:
    return curl(f"http://{gateway}:{port}/anthropic/reflect?text={text}").stdout


def test_credentials_set_per_crew_rotation_and_scrubbing(
    tmp_path: Path, provider: FakeServer, ca_file: str
) -> None:
    import socket

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
    alpha, beta = "127.0.0.31", "127.0.0.32"
    try:
        ours.settimeout(10)
        assert request(ours, control.Ping()) == {"ok": True}
        for name, gateway in (("alpha", alpha), ("beta", beta)):
            sock = listening(gateway, port)
            reply = request(
                ours,
                control.CrewAdd(
                    name=name, gateway=gateway, listener=True, ssrf_allow=("127.0.0.0/8",)
                ),
                sock,
            )
            sock.close()
            assert reply["ok"], reply

        reply = request(ours, control.CredentialsSet(crews={"alpha": {"anthropic": KEY_ONE}}))
        assert reply == {"ok": True, "changed": True}
        provider.clear()
        done = leak(alpha, port)
        assert provider.last().all("x-api-key") == [KEY_ONE]
        assert KEY_ONE not in done.stdout and "REDACTED" in done.stdout.upper(), done.stdout
        # Another crew keeps the configured key; the store's is scrubbed from its responses too.
        leak(beta, port)
        assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]
        assert KEY_ONE not in reflect(beta, port, KEY_ONE)

        # Rotation: the next request carries the new key, within a second of the message.
        request(ours, control.CredentialsSet(crews={"alpha": {"anthropic": KEY_TWO}}))
        started = time.monotonic()
        done = leak(alpha, port)
        assert provider.last().all("x-api-key") == [KEY_TWO]
        assert time.monotonic() - started < 1.0
        assert KEY_TWO not in done.stdout
        # The rotated-away key is still scrubbed (it may be live at the provider).
        assert KEY_ONE not in reflect(alpha, port, KEY_ONE)
        assert "plain-text" in reflect(alpha, port, "plain-text")

        # Revocation: an empty map; the crew falls back to the configured key.
        assert request(ours, control.CredentialsSet(crews={}))["ok"]
        leak(alpha, port)
        assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]

        # Bad input is refused whole, naming crew and provider, never echoing the value.
        bad = request(
            ours,
            control.CredentialsSet(
                crews={"alpha": {"anthropic": KEY_ONE}, "beta": {"nosuch": "sk-secret-x"}}
            ),
        )
        assert not bad["ok"] and "'beta'" in bad["error"] and "nosuch" in bad["error"]
        assert "sk-secret-x" not in bad["error"]
        bad = request(ours, control.CredentialsSet(crews={"alpha": {"openai": "sk-bad\nvalue"}}))
        assert not bad["ok"] and "sk-bad" not in bad["error"]
        leak(alpha, port)  # nothing of the refused maps was applied
        assert provider.last().all("x-api-key") == [REAL_KEYS["anthropic"]]

        # The proxy process: not dumpable, no core limit, no value in argv or environment.
        request(ours, control.CredentialsSet(crews={"alpha": {"anthropic": KEY_ONE}}))
        # (RLIMIT_CORE and the dumpable flag are set by one call, privileges.forbid_core_dumps,
        # whose effect on the flag test_forbid_core_dumps checks in a process of its own.)
        assert core_limit(process.pid) == ("0", "0")
        for name in ("cmdline", "environ"):
            data = Path(f"/proc/{process.pid}/{name}").read_bytes()
            assert KEY_ONE.encode() not in data and KEY_TWO.encode() not in data
    finally:
        ours.close()
        deadline = time.monotonic() + 10
        while process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        if process.poll() is None:
            process.kill()
        process.wait()
        assert process.stderr is not None
        stderr = process.stderr.read().decode()
    assert KEY_ONE not in stderr and KEY_TWO not in stderr
