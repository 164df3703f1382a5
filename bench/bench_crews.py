"""Crews: how long until a new crew can run a command, and what `run` costs, against bare Docker.

Theory of operation
-------------------
One applianced is started for the run (as `appliancectl demo` starts it: a temporary state,
an unrouted /24, an nftables table and crew-name prefix of its own, the real agent and infra
images). Then, for each of --crews rounds (50), interleaved so that whatever else the machine
does hits every series alike, and with the order inside a round alternating:

    crew ready       `appliancectl crew create NAME --mode restricted` (it returns when the
                     agent container runs, ready to exec), then the first `appliancectl run
                     NAME -- true`; the crew is removed at the end of the round (also timed).
                     With --infra-pool N (2, the daemon's default) the pool is full before the
                     create and refilled right after the first run, before anything else is
                     measured (time waited: not in any series, reported as pool_refill_wait)
    docker run       `docker run --rm AGENT_IMAGE true` (the engine's defaults: bridge network)
    docker run (hardened)  the same with the agent's flags: --network none, --user 1001,
                     --cap-drop ALL, no-new-privileges, --read-only, --init, /tmp tmpfs, limits
    run overhead     --runs (3) of each, interleaved, in the round's crew:
                       `appliancectl run NAME -- true`  vs  `docker exec AGENT true`   (CLIs)
                       AdminClient.run(NAME, [true])    vs  docker SDK exec of `true` (in-process)
                     the in-process pair leaves out the two CLIs' start-up (Python vs Go)

Targets (the crews issue): crew ready under 1.5x a bare `docker run`; `run` under 30 ms over a
bare `docker exec`. Every command runs on this machine only; no packet leaves it (the crews run
`true`). CPU used by other processes during the run is recorded (common.ForeignLoad).

    python bench/bench_crews.py [--crews 50] [--runs 3] [--json-out bench/results/crews.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TARGET_READY_RATIO = 1.5
TARGET_RUN_OVERHEAD_MS = 30.0


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1))))
    return ordered[rank]


def summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1000 for s in seconds]
    return {
        "n": len(ms),
        "p50_ms": round(statistics.median(ms), 1),
        "p99_ms": round(percentile(ms, 99), 1),
        "min_ms": round(min(ms), 1),
        "max_ms": round(max(ms), 1),
    }


def timed(argv: list[str], env: dict[str, str] | None = None) -> float:
    started = time.perf_counter()
    done = subprocess.run(argv, capture_output=True, text=True, env=env)
    elapsed = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} exited {done.returncode}: {done.stderr[-500:]}")
    return elapsed


def hardened_run(image: str) -> list[str]:
    """`docker run` with the agent container's hardening (appliance/runtime/docker.py)."""
    return [
        "docker", "run", "--rm", "--network", "none", "--user", "1001:1001",
        "--cap-drop", "ALL", "--security-opt", "no-new-privileges", "--read-only", "--init",
        "--tmpfs", "/tmp:rw,nosuid,nodev,size=500m,mode=1777", "--pids-limit", "200",
        "--memory", "256m", "--memory-swap", "256m", "--cpus", "1", image, "true",
    ]  # fmt: skip


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import docker

    from appliance.ctl.client import AdminClient
    from appliance.demo import DemoAppliance
    from appliance.runtime.engine import ensure_dockerd
    from images.build import ensure_images

    client: docker.DockerClient = ensure_dockerd()
    built = ensure_images()
    # Private tags for the run: `images.build --prune` (or a rebuild) elsewhere on the machine
    # must not pull the images from under a 50-crew run. Removed at the end.
    images = type(built)(
        base=built.base,
        infra=built.infra.replace("agent-appliance/", "agent-appliance-bench/"),
        agent=built.agent.replace("agent-appliance/", "agent-appliance-bench/"),
    )
    for source, private in ((built.infra, images.infra), (built.agent, images.agent)):
        client.images.get(source).tag(private)
    workdir = Path(tempfile.mkdtemp(prefix="bench-crews-"))
    app = DemoAppliance(workdir)
    app.write_config(
        images.agent,
        images.infra,
        None,
        None,
        extra_daemon=args.daemon_extra,
        extra_crews=f"infra_pool = {args.infra_pool}",
    )
    # appliancectl as installed: the launcher (bin/appliancectl, a venv's copy of it) of the tree
    # under test, with this interpreter first on PATH as in a venv's bin/: `run` takes the fast
    # path under `python -S`, everything else goes on to appliance.cli. For comparison, the
    # same fast path started the ordinary way (site and its .pth files, as a pip console script).
    launcher = Path(__file__).resolve().parent.parent / "bin" / "appliancectl"
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    cli_env = {**os.environ, "PATH": path}
    cli = [str(launcher), "--socket", str(app.socket)]
    with_site = [sys.executable, "-m", "appliance.ctl", "--socket", str(app.socket)]
    series: dict[str, list[float]] = {
        k: []
        for k in (
            "crew_create",
            "first_run",
            "crew_ready_and_first_run",
            "crew_rm",
            "docker_run",
            "docker_run_hardened",
            "appliancectl_run",
            "docker_exec_cli",
            "ctl_with_site_run",
            "api_run",
            "sdk_exec",
        )
    }
    pool_waits: list[float] = []
    started = time.monotonic()
    load = common.ForeignLoad(None)
    try:
        status = app.start()
        print(
            f"applianced pid {status['pid']} (pool {app.pool}, table {app.net_table}); "
            f"agent image {images.agent}",
            flush=True,
        )
        admin = AdminClient(str(app.socket))
        # One of each, unmeasured: the page cache and the engine's image metadata warm.
        timed(["docker", "run", "--rm", images.agent, "true"])
        with load:
            for index in range(args.crews):
                name = f"{app.name_prefix}b{index}"

                def crew_round(name: str = name) -> None:
                    pool_waits.append(_wait_pool_full(admin))
                    create = timed([*cli, "crew", "create", name, "--mode", "restricted"], cli_env)
                    first = timed([*cli, "run", name, "--", "true"], cli_env)
                    # The refill runs now, not during the next measurement.
                    pool_waits.append(_wait_pool_full(admin))
                    series["crew_create"].append(create)
                    series["first_run"].append(first)
                    series["crew_ready_and_first_run"].append(create + first)

                def docker_rounds() -> None:
                    series["docker_run"].append(
                        timed(["docker", "run", "--rm", images.agent, "true"])
                    )
                    series["docker_run_hardened"].append(timed(hardened_run(images.agent)))

                for work in (
                    (crew_round, docker_rounds) if index % 2 == 0 else (docker_rounds, crew_round)
                ):
                    work()
                agent_id = admin.crew(name).agent_id
                for _ in range(args.runs):
                    series["appliancectl_run"].append(
                        timed([*cli, "run", name, "--", "true"], cli_env)
                    )
                    series["docker_exec_cli"].append(timed(["docker", "exec", agent_id, "true"]))
                    series["ctl_with_site_run"].append(
                        timed([*with_site, "run", name, "--", "true"])
                    )
                    series["api_run"].append(_api_run(admin, name))
                    series["sdk_exec"].append(_sdk_exec(client, agent_id))
                series["crew_rm"].append(timed([*cli, "crew", "rm", name], cli_env))
                if (index + 1) % 10 == 0:
                    print(
                        f"  {index + 1}/{args.crews} crews: create p50 "
                        f"{statistics.median(series['crew_create']) * 1000:.0f} ms, docker run p50 "
                        f"{statistics.median(series['docker_run']) * 1000:.0f} ms",
                        flush=True,
                    )
    finally:
        app.stop()
        app.force_cleanup()
        shutil.rmtree(workdir, ignore_errors=True)
        for private in (images.infra, images.agent):
            client.images.remove(private, noprune=True)
    elapsed = time.monotonic() - started
    results = {name: summary(values) for name, values in series.items() if values}
    ready = results["crew_create"]["p50_ms"]
    ready_first = results["crew_ready_and_first_run"]["p50_ms"]
    bare = results["docker_run"]["p50_ms"]
    hardened = results["docker_run_hardened"]["p50_ms"]
    return {
        "machine": {
            **common.describe_machine(args.source),
            "engine": client.version().get("Version"),
            "runtime": "runc",
            "foreign_load": load.report(),
            "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
        },
        "crews": args.crews,
        "runs_per_crew": args.runs,
        "daemon_extra": args.daemon_extra,
        "infra_pool": args.infra_pool,
        "pool_refill_wait": summary(pool_waits) if pool_waits else None,
        "images": {"agent": images.agent, "infra": images.infra},
        "results": results,
        "ratios": {
            "crew_ready_vs_docker_run_p50": round(ready / bare, 2),
            "crew_ready_vs_docker_run_hardened_p50": round(ready / hardened, 2),
            "crew_ready_and_first_run_vs_docker_run_p50": round(ready_first / bare, 2),
            "run_overhead_cli_p50_ms": round(
                results["appliancectl_run"]["p50_ms"] - results["docker_exec_cli"]["p50_ms"], 1
            ),
            "run_overhead_cli_with_site_p50_ms": round(
                results["ctl_with_site_run"]["p50_ms"] - results["docker_exec_cli"]["p50_ms"], 1
            ),
            "run_overhead_api_p50_ms": round(
                results["api_run"]["p50_ms"] - results["sdk_exec"]["p50_ms"], 1
            ),
        },
        "targets": {
            "crew_ready_ratio": TARGET_READY_RATIO,
            "run_overhead_ms": TARGET_RUN_OVERHEAD_MS,
        },
        "elapsed_s": round(elapsed, 1),
    }


def _wait_pool_full(admin: Any, timeout: float = 60.0) -> float:
    """Until every pool slot is ready (a crew create takes one, the daemon refills it in the
    background); returns the seconds waited. Not part of any measured series."""
    started = time.perf_counter()
    while True:
        status = admin.status()
        if status.pool_ready >= status.pool_size:
            return time.perf_counter() - started
        if time.perf_counter() - started > timeout:
            raise RuntimeError(f"the infra pool did not refill within {timeout:g} s: {status}")
        time.sleep(0.02)


def _api_run(admin: Any, name: str) -> float:
    from appliance.ctl.session import exited_of
    from appliance.daemon import framing

    started = time.perf_counter()
    code = None
    session = admin.run(name, ["true"])
    try:
        for kind, payload in session.frames():
            if kind == framing.EXIT:
                code = exited_of(payload).exit_code
    finally:
        session.close()
    elapsed = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"run true in {name} exited {code}")
    return elapsed


def _sdk_exec(client: Any, container_id: str) -> float:
    """What a program holding the engine's socket does for one command: create, start, read to
    the end, inspect the exit code (the same engine calls as the appliance's exec)."""
    started = time.perf_counter()
    created = client.api.exec_create(container_id, ["true"], stdout=True, stderr=True)
    for _ in client.api.exec_start(created["Id"], stream=True, demux=True):
        pass
    code = client.api.exec_inspect(created["Id"])["ExitCode"]
    elapsed = time.perf_counter() - started
    if code != 0:
        raise RuntimeError(f"docker exec true exited {code}")
    return elapsed


LABELS = {
    "crew_create": "appliancectl crew create (until exec-ready)",
    "first_run": "first appliancectl run -- true",
    "crew_ready_and_first_run": "crew create + first run",
    "docker_run": "docker run --rm AGENT true",
    "docker_run_hardened": "docker run --rm (agent's hardening, network none) true",
    "crew_rm": "appliancectl crew rm",
    "appliancectl_run": "appliancectl run NAME -- true",
    "docker_exec_cli": "docker exec AGENT true",
    "ctl_with_site_run": "python -m appliance.ctl run NAME -- true (with site)",
    "api_run": "admin API run [true] (in-process client)",
    "sdk_exec": "docker SDK exec true (in-process)",
}


def print_tables(data: dict[str, Any]) -> None:
    common.header(f"Crews: creation and run ({data['crews']} crews, runc)")
    rows = [
        [LABELS[key], r["n"], r["p50_ms"], r["p99_ms"], r["min_ms"], r["max_ms"]]
        for key, r in data["results"].items()
    ]
    print(common.table(["what", "n", "p50 ms", "p99 ms", "min ms", "max ms"], rows))
    ratios = data["ratios"]
    print()
    print(
        common.table(
            ["measure", "value", "target"],
            [
                ["crew ready / docker run (p50)", ratios["crew_ready_vs_docker_run_p50"], "< 1.5"],
                [
                    "crew ready / hardened docker run (p50)",
                    ratios["crew_ready_vs_docker_run_hardened_p50"],
                    "< 1.5",
                ],
                [
                    "(crew ready + first run) / docker run (p50)",
                    ratios["crew_ready_and_first_run_vs_docker_run_p50"],
                    "",
                ],
                ["run overhead, CLIs (ms, p50)", ratios["run_overhead_cli_p50_ms"], "< 30"],
                [
                    "run overhead, python -m appliance.ctl (ms, p50)",
                    ratios["run_overhead_cli_with_site_p50_ms"],
                    "",
                ],
                ["run overhead, in-process (ms, p50)", ratios["run_overhead_api_p50_ms"], "< 30"],
            ],
        )
    )
    machine = data["machine"]
    print(
        f"\nmachine: {machine['versions']['cpu']}, {machine['versions']['cores']} cores, engine "
        f"{machine['engine']}; other processes used {machine['foreign_load']['foreign_cpu_pct']}% "
        f"of a core during the run ({', '.join(machine['foreign_load']['foreign_top'])}); "
        f"total {data['elapsed_s']} s"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--crews", type=int, default=50, help="crews created and removed (50)")
    parser.add_argument("--runs", type=int, default=3, help="runs of each kind per crew (3)")
    parser.add_argument(
        "--infra-pool",
        type=int,
        default=2,
        help="[crews] infra_pool of the daemon (2, the default; 0: no pool)",
    )
    parser.add_argument("--source", type=Path, default=common.REPO, help="tree under test")
    parser.add_argument(
        "--daemon-extra", default="", help="extra [daemon] TOML lines for applianced"
    )
    parser.add_argument("--json-out", type=Path, default=common.RESULTS_DIR / "crews.json")
    # Accepted for run_all.py; this suite has no load generator to wait or retry for.
    parser.add_argument("--wait-quiet", type=float, default=0.0, help=argparse.SUPPRESS)
    parser.add_argument("--retry-busy", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--repeat", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_crews: needs root (applianced, the engine)", file=sys.stderr)
        return 1
    if not 1 <= args.crews <= 60:
        parser.error("argument --crews: 1..60 (the bench's /24 holds 64 crews)")
    data = measure(args)
    common.write_json(args.json_out, data)
    print_tables(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
