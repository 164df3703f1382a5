"""Where our proxy's CPU goes under load: py-spy samples, summed per function (not a benchmark).

Theory of operation
-------------------
The same origin and proxy configuration as bench_h2.py; the load is h2load (h2c, `--level CxM`,
to the HTTP/1.1 or h2c upstream leg) or wrk -c50 over HTTP/1.1 (`--http1`). After 2 s of load,
`py-spy record -f raw` samples the proxy for `--seconds` at 250 Hz; each sample is attributed
to its innermost Python frame (a socket call's time lands on the function that makes it), and
the functions are printed by their share of the samples, self or inclusive. py-spy is not a
project dependency: `pip install py-spy` into any environment and pass `--py-spy PATH`.

    python bench/profile_ours.py --level 50x1 --leg h1 --seconds 15 --py-spy /tmp/tools/bin/py-spy
    python bench/profile_ours.py --http1 --seconds 15 --py-spy /tmp/tools/bin/py-spy
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_h2
import common
from common import Workspace


def summarize(raw: Path, *, inclusive: bool, top: int) -> str:
    own: collections.Counter[str] = collections.Counter()
    within: collections.Counter[str] = collections.Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        samples = int(count)
        total += samples
        frames = [re.sub(r":\d+\)", ")", frame) for frame in stack.split(";")[1:]]
        if frames:
            own[frames[-1]] += samples
        for frame in set(frames):
            within[frame] += samples
    counts = within if inclusive else own
    rows = [f"{100 * n / total:5.1f}% {name}" for name, n in counts.most_common(top)]
    return "\n".join([f"{total} samples", *rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", default="50x1", help="h2load -c C -m M as CxM")
    parser.add_argument("--leg", default="h1", choices=bench_h2.LEGS, help="upstream leg")
    parser.add_argument("--http1", action="store_true", help="wrk -c50 over HTTP/1.1 instead")
    parser.add_argument("--seconds", type=int, default=15)
    parser.add_argument("--py-spy", default="py-spy", help="the py-spy executable")
    parser.add_argument("--inclusive", action="store_true", help="time within, not own")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args(argv)
    raw = Path(tempfile.mkdtemp(prefix="profile-")) / "samples.txt"
    setup = argparse.Namespace(source=common.REPO, connections=1000)
    with Workspace() as ws:
        origin = bench_h2.start_origin(ws)
        ours = bench_h2.start_ours(ws, setup, origin)
        leg = "h1" if args.http1 else args.leg
        authority = bench_h2.authority_for("ours", origin, leg)
        run_for = f"{args.seconds + 4}s"
        if args.http1:
            script = common.wrk_script(ws, f"http://{authority}/1k", authority)
            load = ["wrk", "-t1", "-c50", f"-d{run_for}", "-s", str(script)]
            load.append(f"http://{ours.host}:{ours.port}")
        else:
            clients, streams = args.level.split("x")
            load = ["h2load", "-t1", f"-c{clients}", f"-m{streams}", "-D", run_for]
            load += ["-H", f":authority: {authority}", f"http://{ours.host}:{ours.port}/1k"]
        loader = subprocess.Popen(
            common.pinned(common.LOAD_CORE, load), stdout=subprocess.PIPE, text=True
        )
        time.sleep(2)
        spy = [args.py_spy, "record", "--subprocesses", "-r", "250", "-d", str(args.seconds)]
        spy += ["-f", "raw", "-o", str(raw), "-p", str(ours.pid)]
        subprocess.run(spy, check=True, capture_output=True)
        output, _ = loader.communicate()
    for line in output.splitlines():
        if "Requests/sec" in line or "finished in" in line:
            print(line.strip())
    print(summarize(raw, inclusive=args.inclusive, top=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
