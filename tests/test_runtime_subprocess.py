"""The subprocess provider (no isolation): real processes, real kills."""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

import pytest
import trio

from appliance.runtime import CrewContainerError, CrewSpec, ExecExited, ExecOutput, InvalidSpec
from appliance.runtime.subprocess_provider import NO_ISOLATION, SubprocessProvider


@pytest.fixture
def provider(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> SubprocessProvider:
    caplog.set_level(logging.INFO, logger="appliance.runtime.subprocess_provider")
    provider = SubprocessProvider(tmp_path)
    spec = CrewSpec(name="solo", image="-", infra_image="-", env={"CREW_VAR": "from-spec"})
    pod = provider.create_infra(spec)
    provider.start_agent(spec, pod)
    return provider


async def collect(
    provider: SubprocessProvider, argv: list[str], **kwargs: object
) -> tuple[str, str, ExecExited]:
    out: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
    exited = None
    async for event in provider.exec("solo", argv, **kwargs):  # type: ignore[arg-type]
        if isinstance(event, ExecOutput):
            out[event.stream].append(event.line)
        else:
            exited = event
    assert exited is not None
    return b"".join(out["stdout"]).decode(), b"".join(out["stderr"]).decode(), exited


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_says_no_isolation_everywhere(
    tmp_path: Path, provider: SubprocessProvider, caplog: pytest.LogCaptureFixture
) -> None:
    assert provider.name == "subprocess" and provider.isolated is False
    assert "NO ISOLATION" in (SubprocessProvider.__doc__ or "")
    pod = provider.create_infra(CrewSpec(name="other", image="-", infra_image="-"))
    trio.run(collect, provider, ["true"])
    records = caplog.get_records("setup") + caplog.get_records("call")
    messages = [record.getMessage() for record in records]
    assert len(messages) >= 5, messages  # selected, pod, agent, pod, exec
    assert all(NO_ISOLATION in message for message in messages), messages
    # There is no pod: its namespace path leads nowhere, so no network can be attached to it.
    assert pod.infra_pid == 0 and not os.path.exists(pod.netns_path)
    assert NO_ISOLATION in pod.runtime


async def test_exec_runs_argv_without_a_shell_with_a_clean_environment(
    provider: SubprocessProvider, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APPLIANCE_TEST_SECRET", "must-not-leak")
    stdout, _, exited = await collect(provider, ["echo", "$HOME", "a  b"])
    assert stdout == "$HOME a  b\n" and exited.exit_code == 0
    stdout, _, _ = await collect(provider, ["env"], env={"CALL_VAR": "x"})
    variables = dict(line.split("=", 1) for line in stdout.splitlines())
    assert "APPLIANCE_TEST_SECRET" not in variables
    assert variables["CREW_VAR"] == "from-spec" and variables["CALL_VAR"] == "x"
    assert variables["HOME"] == str(provider.home("solo"))
    stdout, _, _ = await collect(provider, ["pwd"])
    assert stdout == f"{provider.home('solo')}\n"


async def test_exec_streams_lines_in_order_with_exit_codes(provider: SubprocessProvider) -> None:
    script = 'for i in $(seq 1 500); do echo "line $i"; done; echo oops >&2; printf tail; exit 7'
    stdout, stderr, exited = await collect(provider, ["sh", "-c", script])
    assert stdout == "".join(f"line {i}\n" for i in range(1, 501)) + "tail"
    assert stderr == "oops\n"
    assert exited == ExecExited(exit_code=7)
    _, _, exited = await collect(provider, ["true"])
    assert exited.exit_code == 0
    _, _, exited = await collect(provider, ["sh", "-c", "kill -9 $$"])
    assert exited.exit_code == 128 + 9


async def test_timeout_kills_the_process_group(provider: SubprocessProvider) -> None:
    began = time.monotonic()
    stdout, _, exited = await collect(
        provider, ["sh", "-c", "sleep 30 & echo $!; wait"], timeout=0.5
    )
    assert exited == ExecExited(exit_code=-1, timed_out=True)
    assert time.monotonic() - began < 3
    child = int(stdout.split()[0])
    deadline = time.monotonic() + 3
    while alive(child):
        assert time.monotonic() < deadline, f"pid {child} survived the timeout"
        await trio.sleep(0.05)


async def test_cancellation_kills_the_process_group(provider: SubprocessProvider) -> None:
    pids: list[int] = []
    with trio.move_on_after(0.5):
        async for event in provider.exec("solo", ["sh", "-c", "sleep 31 & echo $! $$; wait"]):
            assert isinstance(event, ExecOutput)
            pids += [int(pid) for pid in event.line.split()]
    assert len(pids) == 2
    deadline = time.monotonic() + 3
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < deadline, "a process survived the cancellation"
        await trio.sleep(0.05)


async def test_bad_calls_are_refused(provider: SubprocessProvider) -> None:
    with pytest.raises(CrewContainerError, match="no agent started"):
        await collect_for(provider, "nobody", ["true"])
    with pytest.raises(InvalidSpec):
        await collect(provider, [])
    with pytest.raises(InvalidSpec):
        await collect(provider, ["true"], timeout=0)
    with pytest.raises(InvalidSpec):
        provider.create_infra(CrewSpec(name="bad name", image="-", infra_image="-"))
    provider.remove_crew("solo", volumes=True)
    provider.remove_crew("solo")  # idempotent
    assert provider.owned() == []
    assert not provider.home("solo").exists()


async def collect_for(provider: SubprocessProvider, crew: str, argv: list[str]) -> None:
    async for _ in provider.exec(crew, argv):
        pass
