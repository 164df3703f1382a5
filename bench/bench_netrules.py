"""A crew's address-rule change among N crews: the batch's size and its time, on the real kernel.

For each N (1, 50 and 500 by default), a table of its own holds N crews' chains and sets (each
with the same four rules; no links, no namespaces: what is measured is the nftables work), made
by one rebuild (timed too, for comparison). Then one crew's rules are changed --changes times,
alternating between two rule lists, each change the batch `Layout.set_rules` builds (the crew's
two sets replaced in one transaction). Reported: the batch's command count and the median and
95th percentile time of one change. The kernel's work is the crew's two sets; libnftables lists
every set of the table into its cache before it adds an element, which is what grows with N.

Needs root. The table (`bench_netrules_<random>`) is deleted at the end; no packet is sent.

    python bench/bench_netrules.py [--crews 1,50,500] [--changes 200]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from netns.addressing import parse_pool, plan_for
from netns.netrules import parse_rules
from netns.nft import Layout, default_backend

RULES = (
    "allow:tcp:198.51.100.0/24:5432",
    "allow:tcp:198.51.100.0/24:8000-8100",
    "deny:tcp:198.51.100.10/32:8080",
    "allow:udp:198.51.100.10/32:53",
)
# Not routed anywhere: the table refuses its pool to all but its (absent) crews while it exists,
# so not a pool the test suite uses (100.90.x and 100.91.x: a run beside it would lose traffic).
POOL = "100.93.0.0/21"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--crews", default="1,50,500")
    parser.add_argument("--changes", type=int, default=200)
    args = parser.parse_args()
    pool = parse_pool(POOL)
    backend = default_backend()
    tag = uuid.uuid4().hex[:6]
    try:
        for count in (int(n) for n in args.crews.split(",")):
            layout = Layout(
                table=f"bench_netrules_{tag}",
                priority=-150,
                ifname_prefix=f"q{tag[:3]}",
                proxy_ports=(9119,),
                pool=POOL,
            )
            plans = [plan_for(pool, layout.ifname_prefix, f"crew-{i}", i) for i in range(count)]
            rules = {plan.crew: parse_rules(RULES, pool) for plan in plans}
            started = time.perf_counter()
            backend.run(layout.rebuild(plans, rules))
            rebuild = time.perf_counter() - started
            times = []
            size = 0
            for i in range(args.changes):
                batch = layout.set_rules(plans[count // 2], parse_rules(RULES[i % 2 :], pool))
                size = len(batch)
                started = time.perf_counter()
                backend.run(batch)
                times.append(time.perf_counter() - started)
            times.sort()
            print(
                f"crews={count:5d}  rebuild {rebuild * 1000:8.1f} ms  one change: {size} "
                f"commands, median {statistics.median(times) * 1000:.2f} ms, "
                f"p95 {times[int(len(times) * 0.95) - 1] * 1000:.2f} ms"
            )
            backend.run(layout.delete_table())
    finally:
        backend.close()


if __name__ == "__main__":
    main()
