"""Crew A's HTTP/2 attacks for the chaos suite (tests/test_chaos.py): the known floods as raw
frames, and ordinary h2 faults (a stream's upstream resetting beside healthy siblings, the
agent resetting streams mid-response, the agent vanishing with streams in flight).

The floods aim their streams at the silent peer (port SILENT) and the ordinary faults at the
other peers, so the journal tells them apart by port: the ordinary faults are counted exactly
(every stream one terminal event), the floods by their connection refusals (each flood
connection exactly one `request_refused` naming its rule). A flood's streams are bounded
above by what was sent: which of them the proxy had started when the limit tripped depends on
how the kernel split the bytes, so their exact count is not knowable from outside.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events
import trio
from hyperframe.frame import GoAwayFrame, SettingsFrame

from proxycore.protocol.http2 import PREFACE, ErrorCode
from tests import chaos_peers as peers
from tests.chaos_attacks import MARGIN, Attack
from tests.chaos_support import PEER_NAME
from tests.chaos_world import reset_close
from tests.h2_client import parse_frames
from tests.h2_floods import FLOODS, FrameMaker

FLOOD_AUTHORITY = f"{PEER_NAME}:{peers.SILENT}".encode()


# --- the floods (tests/h2_floods.py) ------------------------------------------------------------


@dataclass
class FloodTally:
    """What the floods sent: connections per rule, and the streams they opened."""

    connections: dict[str, int] = field(default_factory=dict)
    streams: int = 0


async def floods(attack: Attack, tally: FloodTally, rounds: int = 2) -> None:
    """Every flood, `rounds` connections each, all at once: each must end in its GOAWAY (the
    code the attack earns) within seconds."""

    async def one(name: str) -> None:
        build, code, rule = FLOODS[name]
        stream = await attack.chaos.connect_a()
        flood = FrameMaker(FLOOD_AUTHORITY, b"/flood")
        data = PREFACE + SettingsFrame(0).serialize() + build(flood)
        tally.streams += flood.streams
        tally.connections[rule] = tally.connections.get(rule, 0) + 1
        received = bytearray()
        with trio.move_on_after(8 + MARGIN) as scope:
            try:
                await stream.send_all(data)
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass  # the proxy closed while the flood was still going out
            try:
                while chunk := await stream.receive_some(65536):
                    received += chunk
            except (trio.BrokenResourceError, trio.ClosedResourceError):
                pass
        await stream.aclose()
        if scope.cancelled_caught:
            attack.problem(name, "the proxy did not end the connection")
        away = [f for f in parse_frames(bytes(received)) if isinstance(f, GoAwayFrame)]
        if not away or away[-1].error_code != code:
            attack.problem(name, f"expected GOAWAY {ErrorCode(code).name}, got {away[-1:]}")

    await attack.run(
        ((f"{name} #{i}", lambda name=name: one(name)) for name in FLOODS for i in range(rounds)),
        timeout=30,
    )


# --- ordinary faults, with h2's client state machine -------------------------------------------


@dataclass
class Answer:
    status: int | None = None
    body: bytearray = field(default_factory=bytearray)
    ended: bool = False
    reset: int | None = None


class Agent:
    """An h2c client on a trio stream (h2's state machine; flow control credited as read)."""

    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.h2 = h2.connection.H2Connection(
            h2.config.H2Configuration(client_side=True, header_encoding=None)
        )
        self.answers: dict[int, Answer] = {}
        self.goaway: h2.events.ConnectionTerminated | None = None
        self.closed = False

    @classmethod
    async def open(cls, attack: Attack) -> Agent:
        agent = cls(await attack.chaos.connect_a())
        agent.h2.initiate_connection()
        await agent.flush()
        return agent

    async def flush(self) -> None:
        data = self.h2.data_to_send()
        if data:
            await self.stream.send_all(data)

    async def get(self, attack: Attack, authority: str, path: str) -> int:
        stream_id = self.h2.get_next_available_stream_id()
        self.h2.send_headers(
            stream_id,
            [
                (b":method", b"GET"),
                (b":scheme", b"http"),
                (b":authority", authority.encode()),
                (b":path", path.encode()),
            ],
            end_stream=True,
        )
        self.answers[stream_id] = Answer()
        await self.flush()
        attack.requests += 1
        return stream_id

    async def pump(self, done: Callable[[], bool], timeout: float, *, credit: bool = True) -> bool:
        """Read and handle frames until `done()` (True) or the timeout or the end (False)."""
        with trio.move_on_after(timeout):
            while not done():
                try:
                    data = await self.stream.receive_some(65536)
                except (trio.BrokenResourceError, trio.ClosedResourceError):
                    data = b""
                if not data:
                    self.closed = True
                    return done()
                for event in self.h2.receive_data(data):
                    self._handle(event, credit)
                await self.flush()
            return True
        return False

    def _handle(self, event: h2.events.Event, credit: bool) -> None:
        if isinstance(event, h2.events.ResponseReceived):
            headers = dict(event.headers)
            self.answers[event.stream_id].status = int(headers[b":status"])
        elif isinstance(event, h2.events.DataReceived):
            self.answers[event.stream_id].body += event.data
            if credit:
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        elif isinstance(event, h2.events.StreamEnded):
            self.answers[event.stream_id].ended = True
        elif isinstance(event, h2.events.StreamReset):
            self.answers[event.stream_id].reset = int(event.error_code)
        elif isinstance(event, h2.events.ConnectionTerminated):
            self.goaway = event


def _finished(answer: Answer) -> bool:
    return answer.ended or answer.reset is not None


async def upstream_resets_beside_siblings(attack: Attack, streams: int = 20) -> None:
    """Half the streams of one connection go to an upstream that resets before answering:
    each of those is a readable 502 on its own stream; the other half are answered whole; the
    connection lives on and serves one more."""
    label = "upstream resets beside siblings"
    agent = await Agent.open(attack)
    failing: list[int] = []
    healthy: list[int] = []
    for i in range(streams):
        if i % 2:
            failing.append(await agent.get(attack, f"{PEER_NAME}:{peers.RESET}", "/before"))
        else:
            healthy.append(await agent.get(attack, f"{PEER_NAME}:{peers.OK}", "/ok"))
    answers = agent.answers
    if not await agent.pump(lambda: all(_finished(a) for a in answers.values()), 10 + MARGIN):
        attack.problem(label, f"not all streams ended: {answers}")
    for sid in failing:
        if answers[sid].status != 502 or b'"error"' not in answers[sid].body:
            attack.problem(label, f"stream {sid}: expected a readable 502, got {answers[sid]}")
    for sid in healthy:
        if answers[sid].status != 200 or bytes(answers[sid].body) != b"ok\n":
            attack.problem(label, f"stream {sid}: a sibling was hurt: {answers[sid]}")
    if agent.goaway is not None:
        attack.problem(label, f"the connection ended: {agent.goaway}")
    again = await agent.get(attack, f"{PEER_NAME}:{peers.OK}", "/ok")
    await agent.pump(lambda: _finished(answers[again]), 5 + MARGIN)
    if answers[again].status != 200:
        attack.problem(label, f"the connection no longer serves: {answers[again]}")
    await agent.stream.aclose()


async def agent_resets_streams_mid_response(attack: Attack, streams: int = 10) -> None:
    """Slow chunked responses; once their heads arrived, the agent resets every other stream:
    the rest complete, byte for byte."""
    label = "agent resets streams mid-response"
    size = 120_000
    agent = await Agent.open(attack)
    ids = [
        await agent.get(attack, f"{PEER_NAME}:{peers.OK}", f"/slow/{size}") for _ in range(streams)
    ]
    answers = agent.answers
    if not await agent.pump(lambda: all(answers[s].status for s in ids), 5 + MARGIN):
        attack.problem(label, f"not every head arrived: {answers}")
    reset = ids[::2]
    for sid in reset:
        agent.h2.reset_stream(sid, ErrorCode.CANCEL)
    await agent.flush()
    kept = [s for s in ids if s not in reset]
    if not await agent.pump(lambda: all(_finished(answers[s]) for s in kept), 10 + MARGIN):
        attack.problem(label, "the kept streams did not finish")
    for sid in kept:
        if not answers[sid].ended or len(answers[sid].body) != size:
            attack.problem(
                label, f"stream {sid}: {len(answers[sid].body)} of {size} bytes, {answers[sid]}"
            )
    if agent.goaway is not None:
        attack.problem(label, f"the connection ended: {agent.goaway}")
    await agent.stream.aclose()


async def agent_vanishes_with_streams_in_flight(attack: Attack, streams: int = 10) -> None:
    """Large responses held by a window the agent never opens, then the agent's socket is
    reset: every stream still ends (one terminal event each; counted by the caller)."""
    label = "agent vanishes"
    agent = await Agent.open(attack)
    ids = [
        await agent.get(attack, f"{PEER_NAME}:{peers.OK}", "/bytes/100000000")
        for _ in range(streams)
    ]
    if not await agent.pump(lambda: all(agent.answers[s].status for s in ids), 5, credit=False):
        attack.problem(label, f"not every head arrived: {agent.answers}")
    reset_close(agent.stream.socket)
