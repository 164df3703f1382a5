"""applianced speaks sd_notify(3) to a real AF_UNIX datagram socket, as systemd's would be: STATUS=
lines while it starts, READY=1 once the admin socket answers, WATCHDOG=1 every half
WATCHDOG_USEC, a degraded STATUS= while a proxy worker is down, STOPPING=1 on SIGTERM. The
kernel's SCM_CREDENTIALS say which process sent each datagram (systemd checks the same)."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from appliance.daemon.notify import Notifier
from tests.daemon_support import Appliance

_UCRED = struct.Struct("iII")  # pid, uid, gid (struct ucred)


class NotifySocket:
    """What systemd listens on: a datagram socket that receives the sender's credentials."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(str(path))
        self.received: list[tuple[int, float, list[str]]] = []  # (pid, monotonic, assignments)

    def read(self, timeout: float) -> tuple[int, float, list[str]] | None:
        self.sock.settimeout(timeout)
        try:
            data, ancillary, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(_UCRED.size))
        except TimeoutError:
            return None
        pid = -1
        for level, kind, payload in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                pid = _UCRED.unpack(payload[: _UCRED.size])[0]
        message = (pid, time.monotonic(), data.decode().split("\n"))
        self.received.append(message)
        return message

    def wait_for(self, wanted: str, timeout: float = 60) -> tuple[int, float, list[str]]:
        """Read until an assignment starting with `wanted` arrives."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            message = self.read(left)
            if message is not None and any(line.startswith(wanted) for line in message[2]):
                return message
        raise AssertionError(f"no {wanted!r} within {timeout} s; received {self.received}")

    def assignments(self) -> list[str]:
        return [line for _, _, lines in self.received for line in lines]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[NotifySocket]:
    listener = NotifySocket(tmp_path / "notify.sock")
    try:
        yield listener
    finally:
        listener.close()


def test_notifier_sends_datagrams_and_clears_its_environment(notify_socket: NotifySocket) -> None:
    env = {
        "NOTIFY_SOCKET": str(notify_socket.path),
        "WATCHDOG_USEC": "3000000",
        "WATCHDOG_PID": str(os.getpid()),
        "OTHER": "kept",
    }
    notifier = Notifier(env)
    assert env == {"OTHER": "kept"}  # as sd_notify(3)'s unset_environment: children inherit none
    assert notifier.enabled and notifier.watchdog_interval == 1.5
    notifier.status("starting")
    notifier.status("starting")  # unchanged: not sent again
    notifier.ready("serving: 0 crews")
    notifier.stopping()
    notifier.close()
    got = [notify_socket.read(2) for _ in range(3)]
    assert [m[2] for m in got if m] == [
        ["STATUS=starting"],
        ["READY=1", "STATUS=serving: 0 crews"],
        ["STOPPING=1", "STATUS=stopping"],
    ]
    assert {m[0] for m in got if m} == {os.getpid()}
    assert notify_socket.read(0.1) is None


def test_notifier_abstract_address_and_watchdog_for_another_pid() -> None:
    name = f"appliance-test-notify-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        listener.bind(b"\0" + name.encode())
        notifier = Notifier({"NOTIFY_SOCKET": f"@{name}", "WATCHDOG_USEC": "1000000"})
        notifier.send("READY=1")
        listener.settimeout(2)
        assert listener.recv(100) == b"READY=1"
        assert notifier.watchdog_interval == 0.5
        notifier.close()
    other = Notifier({"NOTIFY_SOCKET": "@x", "WATCHDOG_USEC": "1000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_interval is None  # meant for another process
    silent = Notifier({})
    assert not silent.enabled
    silent.ready("nobody listens")  # nothing to do, nothing raised


def test_applianced_notifies_ready_watchdog_degraded_stopping(
    appliance: Appliance, notify_socket: NotifySocket
) -> None:
    app = appliance
    app.start(env={"NOTIFY_SOCKET": str(notify_socket.path), "WATCHDOG_USEC": "400000"})
    assert app.process is not None
    pid = app.process.pid
    ready = notify_socket.wait_for("READY=1")
    # Serving when it says so: the admin socket answers at once.
    code, status = app.ctl_json("status")
    assert code == 0 and status["pid"] == pid
    starting = [line for line in notify_socket.assignments() if line.startswith("STATUS=")]
    assert starting[0] == "STATUS=starting: the engine and the configuration"
    assert "STATUS=starting: reconciling the crews with the state" in starting
    assert any(line.startswith("STATUS=serving: 0 crews, 2 proxy workers") for line in ready[2])
    # Every datagram came from applianced itself (not a worker): NotifyAccess=exec holds.
    assert {sender for sender, _, _ in notify_socket.received} == {pid}

    # WATCHDOG=1 every WATCHDOG_USEC / 2 (0.2 s) while the loop runs: the interval is the one
    # systemd gave (sd_watchdog_enabled(3)), not a constant, so the typical gap is 0.2 s; systemd
    # would act on a gap of WATCHDOG_USEC (0.4 s).
    first = notify_socket.wait_for("WATCHDOG=1", timeout=2)[1]
    for _ in range(10):
        notify_socket.wait_for("WATCHDOG=1", timeout=1)
    beats = [t for _, t, lines in notify_socket.received if "WATCHDOG=1" in lines and t >= first]
    gaps = sorted(later - earlier for earlier, later in itertools.pairwise(beats))
    assert 0.15 <= gaps[len(gaps) // 2] <= 0.3, gaps

    # A proxy worker killed: STATUS= says degraded and why, then serving again once restarted.
    victim = status["proxy_pids"][0]
    os.kill(victim, signal.SIGKILL)
    degraded = notify_socket.wait_for("STATUS=degraded", timeout=10)
    line = next(line for line in degraded[2] if line.startswith("STATUS="))
    assert "proxy worker 0 down (exited: killed by SIGKILL" in line, line
    assert "1 of 2 proxy workers serving" in line
    notify_socket.wait_for("STATUS=serving", timeout=30)

    app.stop()
    assert app.process.returncode == 0
    stopping = notify_socket.wait_for("STOPPING=1", timeout=5)
    assert "STATUS=stopping (SIGTERM)" in stopping[2]
    # The workers' exits on the way out are no degradation: nothing but watchdog beats after.
    while (message := notify_socket.read(0.5)) is not None:
        assert message[2] == ["WATCHDOG=1"], message


def test_a_failed_start_says_why_in_its_status(
    appliance: Appliance, notify_socket: NotifySocket, tmp_path: Path
) -> None:
    app = appliance
    text = app.config.read_text().replace(
        'credential_env = "TEST_ANTHROPIC_KEY"', f'credential_file = "{tmp_path / "none.key"}"'
    )
    app.config.write_text(text)
    with pytest.raises(RuntimeError, match="credential_file"):
        app.start(env={"NOTIFY_SOCKET": str(notify_socket.path)})
    assert app.process is not None and app.process.returncode == 2
    message = notify_socket.wait_for("STATUS=configuration:", timeout=5)
    assert "`proxy.providers.anthropic.credential_file`: cannot read" in message[2][0]
    assert "READY=1" not in notify_socket.assignments()


def test_a_long_image_build_extends_the_start_timeout(
    notify_socket: NotifySocket, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the images are resolved (a first build takes minutes: the unit's ExecStartPre,
    `applianced --build-images`, or a daemon started by hand), EXTEND_TIMEOUT_USEC goes out
    every third of IMAGE_BUILD_EXTEND, so TimeoutStartSec does not kill a build that is
    making progress; it stops once the images are there."""
    import time as time_module

    import trio

    from appliance.daemon import images
    from appliance.daemon.config import parse_config

    def slow_build(config: object) -> tuple[str, str]:
        time_module.sleep(0.7)
        return "agent:tag", "infra:tag"

    monkeypatch.setattr(images, "resolve_images", slow_build)
    monkeypatch.setattr(images, "IMAGE_BUILD_EXTEND", 0.6)
    notifier = Notifier({"NOTIFY_SOCKET": str(notify_socket.path)})
    config = parse_config("", source="<test>")
    assert trio.run(images.resolve_images_notifying, config, notifier) == ("agent:tag", "infra:tag")
    notifier.close()
    while notify_socket.read(0.3) is not None:
        pass
    lines = notify_socket.assignments()
    assert lines[0] == "STATUS=starting: the agent and infra images (a first start builds them)"
    extends = [line for line in lines if line.startswith("EXTEND_TIMEOUT_USEC=")]
    # 0.7 s of build, one every 0.2 s from the start: 4 (3 on a slow scheduler), then none.
    assert 3 <= len(extends) <= 5 and set(extends) == {"EXTEND_TIMEOUT_USEC=600000"}, lines


def test_a_failed_image_build_is_reported_by_its_step(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`applianced --build-images` (the unit's ExecStartPre) names the step that failed and
    why, not the nursery it failed in."""
    from appliance.daemon import images
    from appliance.daemon.config import parse_config
    from images.build import BuildStepError

    def failing_build(config: object) -> tuple[str, str]:
        raise BuildStepError("npm pack", "exited 1", "is the npm registry reachable?")

    monkeypatch.setattr(images, "resolve_images", failing_build)
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert images.build_images_step(parse_config("", source="<test>")) == 1
    err = capsys.readouterr().err
    assert "npm pack" in err and "is the npm registry reachable?" in err, err
    assert "Trio nursery" not in err and "sub-exception" not in err, err
