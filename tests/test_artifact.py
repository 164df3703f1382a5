"""The artifact (`make dist`, docs/artifact.md) runs where the host has no Python for it.

The artifact is built once per source (tests/artifact_support.py: about 30 s with its build
virtualenv kept, cached by the sources' hash, so a second run of the suite reuses it) and run
in a mount namespace where this checkout, its virtualenv and every Python installation of the
host are empty, with an empty environment but PATH:

- `appliancectl --version`, `applianced --version`, `applianced --check` (the links and the
  subcommands);
- a proxy worker started by applianced's ProxyPool as `agent-appliance proxy-worker ... --drop-to`
  from a root-only copy: after its drop it can read none of its own files, and serves a request
  (tests/test_worker_privdrop.py drives such a worker through every path);
- the worker's preload finds in the artifact every module it finds in a virtualenv (a module
  the freeze left out would be skipped silently by the preload and refused at first use);
- with a Docker engine, the whole demo (`appliancectl demo`: applianced, its workers as UID
  1002, a hardened crew, the journal) from the artifact, about 10 s.

The module takes about 12 s with the artifact cached, plus the build (35-55 s) when the sources
changed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from appliance._version import __version__
from appliance.daemon.proxy import CrewEntry, ProxyPool
from proxycore.config import parse_config
from proxycore.preload import preload
from tests.artifact_support import ROOT, built_artifact, hidden_env, private_copy
from tests.conftest import free_port, needs
from tests.worker_support import WORKER_IDS, PoolThread, as_worker_uid, get, http_exchange

pytestmark = pytest.mark.skipif(
    os.geteuid() != 0, reason=needs("root", "a mount namespace hides the host's Pythons")
)

GATEWAY = "127.0.0.71"


@pytest.fixture(scope="module")
def artifact(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return private_copy(built_artifact(), tmp_path_factory.mktemp("artifact"))


def run(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(hidden_env(*argv), capture_output=True, text=True, timeout=60)


def test_no_python_is_left_where_the_artifact_runs(artifact: Path) -> None:
    # The namespace is what the test claims: the host's python3 has no standard library there.
    done = run("sh", "-c", "python3 -c pass")
    assert done.returncode != 0, done
    # This checkout and its virtualenv are empty or gone (a virtualenv inside the checkout, as
    # in a clean clone, is hidden with it).
    listed = 'for p; do [ ! -e "$p" ] || [ -z "$(ls -A "$p")" ] || echo "$p"; done'
    done = run("sh", "-c", listed, "-", sys.prefix, str(ROOT))
    assert done.returncode == 0 and done.stdout == "", done


def test_the_commands_run_from_the_artifact(artifact: Path) -> None:
    assert (
        run(str(artifact / "appliancectl"), "--version").stdout == f"appliancectl {__version__}\n"
    )
    assert run(str(artifact / "applianced"), "--version").stdout == f"applianced {__version__}\n"
    done = run(str(artifact / "agent-appliance"), "appliancectl", "--version")
    assert done.stdout == f"appliancectl {__version__}\n", done
    done = run(str(artifact / "applianced"), "--check", "--json")
    assert done.returncode == 0, done
    assert json.loads(done.stdout)["ok"] is True, done.stdout
    done = run(str(artifact / "agent-appliance"), "nonsense")
    assert done.returncode == 2 and "usage: agent-appliance" in done.stderr, done


def test_the_artifact_preloads_what_a_virtualenv_preloads(artifact: Path) -> None:
    done = run(str(artifact / "agent-appliance"), "proxy-worker", "--preload-check")
    assert done.returncode == 0, done
    frozen = json.loads(done.stdout)
    here = preload()
    assert set(frozen["absent"]) <= set(here.absent), sorted(set(frozen["absent"]) - here.absent)
    assert set(frozen["codecs"]) == set(here.codecs)


class _Upstream(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b"served through the artifact\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        pass


def test_applianced_runs_the_artifacts_worker(artifact: Path, tmp_path: Path) -> None:
    # The root-only copy is out of the workers' reach once they have dropped their privileges.
    denied = as_worker_uid("cat", str(artifact / "agent-appliance"))
    assert denied.returncode != 0 and "Permission denied" in denied.stderr, denied
    upstream = ThreadingHTTPServer(("127.0.0.1", 0), _Upstream)
    threading.Thread(target=upstream.serve_forever, daemon=True).start()
    port = free_port()
    config = parse_config(
        f'[listen]\nport = {port}\n\n[upstream]\nssrf_allow = ["127.0.0.0/8"]\n'
        '\n[upstream.resolve]\n"plain.test" = "127.0.0.1"\n',
        source="test",
    )
    command = hidden_env(str(artifact / "agent-appliance"), "proxy-worker")
    pool = ProxyPool(config, tmp_path, port, workers=1, drop_to=WORKER_IDS, command=command)
    runner = PoolThread(pool).start()
    try:
        runner.call(
            pool.add_crew,
            CrewEntry("alpha", GATEWAY, "restricted", ("plain.test",), ("127.0.0.0/8",)),
        )
        (pid,) = pool.pids
        status = Path(f"/proc/{pid}/status").read_text()
        assert "\nUid:\t1002\t1002\t1002\t1002\n" in status, status
        assert "\nCapEff:\t0000000000000000\n" in status and "\nNoNewPrivs:\t1\n" in status
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[:2] == [str(artifact / "agent-appliance").encode(), b"proxy-worker"]
        target = b"http://plain.test:%d/" % upstream.server_address[1]
        answer = http_exchange(
            (GATEWAY, port), get(target, b"plain.test:%d" % upstream.server_address[1])
        )
        assert answer.status == 200 and answer.body == b"served through the artifact\n", answer
        # A refusal takes the paths that need a codec after the drop (proxycore/preload.py).
        answer = http_exchange(
            (GATEWAY, port), b"CONNECT allowed.test.:443 HTTP/1.1\r\nHost: x\r\n\r\n"
        )
        assert answer.status in (400, 403), answer
        assert pool.pids == (pid,) and pool.restarts == 0
    finally:
        runner.stop()
        upstream.shutdown()
    events = runner.decoded_events()
    assert any(e["event"] == "request_denied" for e in events), events


def test_the_tarball_holds_the_directory() -> None:
    app = built_artifact()
    tarballs = list(app.parent.glob(f"agent-appliance-{__version__}-linux-*.tar.gz"))
    assert len(tarballs) == 1, tarballs
    listing = subprocess.run(
        ["tar", "-tzvf", str(tarballs[0])], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    names = {line.split()[5] for line in listing}
    assert {"agent-appliance/agent-appliance", "agent-appliance/applianced"} <= names
    assert all(line.split()[1] == "root/root" for line in listing), listing[:3]


@pytest.mark.docker
def test_the_demo_runs_from_the_artifact(tmp_path: Path) -> None:
    """The whole tour (`appliancectl demo`: applianced, its workers, a hardened crew, the
    journal) with every process the artifact's, where no Python of the host is visible."""
    if subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        pytest.skip(needs("Docker", "no engine answers `docker info`"))
    # World-readable, as an installed artifact is: the demo's agent user reads nothing of it,
    # but applianced's workers are started from it as root and drop afterwards.
    app = tmp_path / "agent-appliance"
    shutil.copytree(built_artifact(), app, symlinks=True)
    done = subprocess.run(
        hidden_env(str(app / "appliancectl"), "demo"),
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    assert "Uid ['1002', '1002', '1002', '1002'], CapEff 0000000000000000" in out
    assert "invalid x-api-key: [REDACTED:anthropic]" in out
    assert "demo: all 17 steps behaved as expected" in out
