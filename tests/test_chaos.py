"""The hostile-client chaos suite: crew A attacks while crew B works, and nothing else breaks.

Each test runs a real worker pool as applianced does (two workers, UID 1002, events collected),
crews and peers in network namespaces of its own (tests/chaos_support.py), crew B's steady
legitimate stream through the proxy, and one class of attack from crew A
(tests/chaos_attacks.py). After each attack the invariants of tests/chaos_support.py hold: no
worker died, crew B's requests all succeeded in time, every request that reached the proxy has
exactly one terminal event and every tunnel opened was closed, and each worker stayed under the
memory budget. The attacker itself must meet a readable refusal (a status and a JSON body)
wherever the protocol still allows one, never a silent close.

Timeouts are short in these pools (chaos_support.LIMITS: 2 s for heads and reads, 3 s for an
idle tunnel), so every attack ends within seconds.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio

from tests import chaos_attacks as attacks
from tests import chaos_attacks_h2 as h2attacks
from tests import chaos_inputs as inputs
from tests import chaos_peers as peers
from tests.chaos_http import describe
from tests.chaos_support import (
    PEER_NAME,
    ask,
    chaos_pool,
    fd_limit_of,
    memory,
    open_fds,
)
from tests.chaos_world import ChaosWorld, chaos_world

pytestmark = pytest.mark.netns

OK_URL = f"http://{PEER_NAME}:{peers.OK}"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ChaosWorld]:
    with chaos_world(tmp_path_factory.mktemp("chaos")) as made:
        yield made


async def test_quiet_baseline(world: ChaosWorld, tmp_path: Path) -> None:
    """No attack: the invariants hold for crew B alone and for one ordinary request of A's
    (the suite's own control: if this fails, the harness is wrong, not the proxy)."""
    async with chaos_pool(world, tmp_path) as chaos:
        async with chaos.legit() as legit:
            response, _ = await ask(chaos, attacks.get(f"{OK_URL}/ok"))
        problems = [] if response and response.status == 200 else [describe(response)]
        await chaos.check(a_requests=1, legit=legit, problems=problems)


async def test_tunnels_reset_by_client_or_upstream(world: ChaosWorld, tmp_path: Path) -> None:
    """RST and EPIPE mid-tunnel: `curl --max-time 1` through a CONNECT tunnel aborts with a
    reset; the upstream may reset too. One tunnel ends, nothing else does."""
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await attacks.tunnel_resets(attack)
        await chaos.check(a_requests=attack.requests, legit=legit, problems=attack.problems)


async def test_responses_cut_by_client_or_upstream(world: ChaosWorld, tmp_path: Path) -> None:
    """RST and EPIPE mid-response on the forward path (large, chunked and slow responses), and
    an upstream resetting before, inside and after the response head."""
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await attacks.response_resets(attack)
        await chaos.check(a_requests=attack.requests, legit=legit, problems=attack.problems)


async def test_half_open_clients_and_upstreams(world: ChaosWorld, tmp_path: Path) -> None:
    """Clients that half-close and go silent or never read; upstreams that accept and never
    answer; tunnels half-closed toward either: each ends within its timeout."""
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await attacks.half_open(attack)
        await chaos.check(a_requests=attack.requests, legit=legit, problems=attack.problems)


async def test_slowloris_heads_and_connection_flood(world: ChaosWorld, tmp_path: Path) -> None:
    """Heads dribbled under every per-read timeout get 408 at head_timeout; a flood of
    half-sent heads beyond crew A's connection limit gets 503 at once, not crew B."""
    limits = {"max_connections_per_crew": 40}
    async with chaos_pool(world, tmp_path, limits=limits) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await attacks.slowloris_heads(attack)
        await chaos.check(a_requests=attack.requests, legit=legit, problems=attack.problems)


async def test_slowloris_bodies(world: ChaosWorld, tmp_path: Path) -> None:
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await attacks.slowloris_bodies(attack)
        await chaos.check(a_requests=attack.requests, legit=legit, problems=attack.problems)


async def test_nested_and_huge_json_at_the_keeper(world: ChaosWorld, tmp_path: Path) -> None:
    """About 1 KiB of `[[[[...` (and deeper, and objects, and 2 MiB) posted to /keeper/request
    and /keeper/execute: 400 or 413, readable; the worker lives."""
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await inputs.keeper_json(attack)
        await chaos.check(a_requests=attack.requests, legit=legit, problems=attack.problems)


async def test_fd_exhaustion_through_many_upstreams(world: ChaosWorld, tmp_path: Path) -> None:
    """One descriptor per distinct host:port stayed open forever: with the workers' fd limit
    at 256 (`[limits] open_files`), 600 distinct upstream ports must neither kill a worker nor
    starve crew B, and the idle upstream connections are reaped once their idle timeout has
    passed."""
    fd_limit = 256
    idle_timeout = 1.0
    limits = {
        "upstream_idle_timeout": idle_timeout,
        "upstream_connections_per_crew": 64,
        "open_files": fd_limit,
    }
    async with chaos_pool(world, tmp_path, limits=limits) as chaos:
        baseline = {pid: open_fds(pid) for pid in chaos.pids}
        problems = [
            f"worker {pid}: fd limit {limit}, not {fd_limit}"
            for pid in chaos.pids
            if (limit := fd_limit_of(pid)) != fd_limit
        ]
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await attacks.many_upstreams(attack, 600)
        await trio.sleep(idle_timeout + 2)
        for pid in set(chaos.worker_pids()) & set(baseline):
            now = open_fds(pid)
            if now > baseline[pid] + 16:
                problems.append(
                    f"worker {pid}: {now} open descriptors {idle_timeout + 2} s after the "
                    f"attack, {baseline[pid]} before it: idle upstreams were not reaped"
                )
        problems += attack.problems
        await chaos.check(a_requests=attack.requests, legit=legit, problems=problems)


async def test_dns_that_never_answers_one_crew(world: ChaosWorld, tmp_path: Path) -> None:
    """The proxy's own resolver (`[upstream] nameservers`) with per-crew lookup shares
    (`[limits] dns_lookups_per_crew`): crew A floods names the server never answers; crew B's
    names, each distinct (no cache helps), keep resolving at once."""
    nameserver = f"{world.peer}:{peers.DNS}"
    async with chaos_pool(
        world,
        tmp_path,
        upstream={"nameservers": [nameserver]},
        limits={"dns_lookups_per_crew": 4},
        modes=("free", "free"),  # every name passes the name policy: only DNS decides
    ) as chaos:
        attack = attacks.Attack(chaos)
        url = f"http://b{{i}}.b.chaos.test:{peers.OK}/ok"
        async with chaos.legit(url) as legit:
            await attacks.dns_flood(attack, seconds=4)
        log = world.peer_log()
        answered = [line for line in log if line.startswith("dns b") and "answered" in line]
        ignored = [line for line in log if line.startswith("dns a") and "ignored" in line]
        problems = list(attack.problems)
        if not answered or not ignored:
            problems.append(
                f"the nameserver saw {len(answered)} of crew B's names and {len(ignored)} of "
                "crew A's: the proxy did not use [upstream] nameservers"
            )
        await chaos.check(a_requests=attack.requests, legit=legit, problems=problems)


async def test_malformed_upstream_framing(world: ChaosWorld, tmp_path: Path) -> None:
    """Bad chunk sizes, missing CRLFs, conflicting lengths: 502 when nothing was relayed yet;
    after a relayed head, a closed connection. Either way the journal says why."""
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await inputs.bad_upstream_framing(attack)
        await chaos.settle({chaos.crew_a: attack.requests})
        problems = list(attack.problems)
        for event in chaos.events.terminal(chaos.crew_a):
            # Refused (502, nothing relayed yet) with its message; or, once the head was relayed,
            # allowed but cut short, `ended` naming the broken framing.
            if event["event"] == "request_allowed":
                # Fields at their default are not written (events omit defaults).
                ended = event.get("ended", "complete")
                cut = not event.get("complete", True) and "upstream_protocol_error" in ended
                if not cut:
                    problems.append(f"a broken response journaled as a whole one: {event}")
            elif event["event"] != "request_refused" or not event.get("message"):
                problems.append(f"not journaled as a refused exchange with its reason: {event}")
        await chaos.check(a_requests=attack.requests, legit=legit, problems=problems)


async def test_refused_bodies_are_never_parsed_as_requests(
    world: ChaosWorld, tmp_path: Path
) -> None:
    """Bursts of refused requests (403, 404, 405, 400) whose bodies hide a whole request: the
    peer never receives the hidden one, and the connection either goes on with the next real
    request or closes."""
    tag = uuid.uuid4().hex[:8]
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await inputs.refused_with_bodies(attack, tag)
        smuggled = [line for line in world.peer_log() if f"smuggled-{tag}" in line]
        problems = list(attack.problems)
        if smuggled:
            problems.append(f"the peer received {len(smuggled)} hidden requests: {smuggled[:3]}")
        await chaos.check(a_requests=attack.requests, legit=legit, problems=problems)


async def test_odd_connect_authorities(world: ChaosWorld, tmp_path: Path) -> None:
    """CONNECT (and absolute-form) authorities of every odd form: trailing dot, userinfo, IPv6
    zone ids, brackets, percent-encoding, huge/zero/missing ports, non-ASCII bytes, NUL. Each
    gets a readable 400 or 403, from workers that dropped their privileges."""
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await inputs.odd_connects(attack, world.peer)
        await chaos.check(a_requests=attack.requests, legit=legit, problems=attack.problems)


async def test_chunked_request_bodies_are_streamed(world: ChaosWorld, tmp_path: Path) -> None:
    """32 chunked uploads of 8 MiB in flight at once (each holds back its last chunk until all
    have sent the rest): bodies stream to the upstream with flow control, so a worker's peak
    memory grows by far less than the bytes in flight (256 MiB)."""
    async with chaos_pool(world, tmp_path) as chaos:
        before = {pid: memory(pid)["VmRSS"] for pid in chaos.pids}
        attack = attacks.Attack(chaos)
        async with chaos.legit() as legit:
            await attacks.chunked_uploads(attack, count=32, size=8 << 20)
        problems = list(attack.problems)
        for pid, rss in before.items():
            grown = memory(pid)["VmHWM"] - rss
            if grown > 64 << 20:
                problems.append(
                    f"worker {pid}: peak memory grew by {grown >> 20} MiB with 256 MiB of "
                    "chunked bodies in flight (bodies are buffered, not streamed)"
                )
        await chaos.check(a_requests=attack.requests, legit=legit, problems=problems)


async def test_h2_floods_and_stream_faults(world: ChaosWorld, tmp_path: Path) -> None:
    """Crew A speaks h2c: every known flood (tests/chaos_attacks_h2.py, two connections each)
    at once, then ordinary stream faults: an upstream resetting half the streams of a
    connection, the agent resetting streams mid-response, the agent vanishing with streams in
    flight. Crew B's stream and the workers are untouched; each flood connection ends in
    exactly one refusal naming its rule; each ordinary stream in exactly one terminal event."""
    async with chaos_pool(world, tmp_path) as chaos:
        attack = attacks.Attack(chaos)
        tally = h2attacks.FloodTally()
        async with chaos.legit() as legit:
            await h2attacks.floods(attack, tally)
            await attack.run(
                [
                    ("siblings", lambda: h2attacks.upstream_resets_beside_siblings(attack)),
                    ("mid-response", lambda: h2attacks.agent_resets_streams_mid_response(attack)),
                    ("vanish", lambda: h2attacks.agent_vanishes_with_streams_in_flight(attack)),
                ],
                timeout=40,
            )
        refusals_due = sum(tally.connections.values())
        await chaos.settle({chaos.crew_a: attack.requests + refusals_due})
        terminal = chaos.events.terminal(chaos.crew_a)
        problems = list(attack.problems)
        by_rule: dict[str, int] = {}
        for event in terminal:
            if event.get("route") == "connection":
                by_rule[event["rule"]] = by_rule.get(event["rule"], 0) + 1
        if by_rule != tally.connections:
            problems.append(
                f"connection refusals by rule {by_rule}, floods sent {tally.connections}"
            )
        # A flood's streams: at the silent peer, or ended before their exchange named a host.
        flood_streams = [
            e
            for e in terminal
            if e.get("route") != "connection" and e.get("port") in (peers.SILENT, 0, None)
        ]
        if len(flood_streams) > tally.streams:
            problems.append(f"{len(flood_streams)} flood stream events for {tally.streams} sent")
        await chaos.check(
            a_requests=attack.requests + refusals_due + len(flood_streams),
            legit=legit,
            problems=problems,
        )
