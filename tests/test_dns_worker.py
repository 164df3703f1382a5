"""A crew's DNS served by a real worker process: applianced's side of `crew_add` (a listening
socket, then the crew's UDP and TCP DNS sockets, SCM_RIGHTS) over the control socketpair; the
answers follow the crew's own policy object; refusals are `dns_refused` events; `crew_remove`
closes the sockets."""

from __future__ import annotations

import array
import json
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset
import msgspec

from appliance.demo_upstream import FakeServer
from proxycore import control
from proxycore.protocol.events import DnsRefused, decode_events
from tests.conftest import free_port, proxy_env, write_proxy_config

GATEWAY = "127.0.0.41"


def request(channel: socket.socket, message: object, fds: list[socket.socket]) -> dict:
    data = msgspec.json.encode(message) + b"\n"
    if fds:
        numbers = array.array("i", [s.fileno() for s in fds]).tobytes()
        channel.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, numbers)])
    else:
        channel.sendall(data)
    reply = b""
    while not reply.endswith(b"\n"):
        chunk = channel.recv(65536)
        assert chunk, "the proxy closed its channel"
        reply += chunk
    return dict(json.loads(reply))


def ask_udp(port: int, name: str, qtype: str) -> dns.message.Message:
    query = dns.message.make_query(name, qtype)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.settimeout(5)
        sock.sendto(query.to_wire(), (GATEWAY, port))
        return dns.message.from_wire(sock.recv(4096))


def ask_tcp(port: int, name: str, qtype: str) -> dns.message.Message:
    wire = dns.message.make_query(name, qtype).to_wire()
    with socket.create_connection((GATEWAY, port), timeout=5) as sock:
        sock.sendall(struct.pack(">H", len(wire)) + wire)
        data = b""
        while len(data) < 2 or len(data) < 2 + struct.unpack(">H", data[:2])[0]:
            chunk = sock.recv(4096)
            assert chunk
            data += chunk
    return dns.message.from_wire(data[2:])


def addresses(answer: dns.message.Message) -> set[str]:
    return {item.to_text() for rrset in answer.answer for item in rrset}


EXAMPLE_RDATA = {
    "TXT": '"hello"',
    "MX": "10 mail.x.test.",
    "HINFO": '"cpu" "os"',
    "SRV": "0 5 5060 sip.x.test.",
    "CAA": '0 issue "ca.test"',
    "NAPTR": '100 10 "U" "E2U+sip" "!^.*$!sip:a@x.test!" .',
    "SSHFP": "1 1 123456789abcdef67890123456789abcdef67890",
    "TLSA": "3 1 1 0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef",
    "LOC": "52 22 23.000 N 4 53 32.000 E -2.00m 0.00m 10000m 10m",
    "URI": '10 1 "https://x.test/"',
}


def test_crew_dns_served_by_the_worker(tmp_path: Path, provider: FakeServer, ca_file: str) -> None:
    port = free_port()
    # The worker writes its events after its privilege drop: a directory it may write in.
    shared = Path(tempfile.mkdtemp(prefix="apx-dns-worker-"))
    shared.chmod(0o777)
    config, events, _ = write_proxy_config(
        shared, port=port, provider_port=provider.port, ca_file=ca_file, gateway="127.0.0.40"
    )
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        # Privileges dropped, as applianced runs it: every import after the drop is refused
        # and named on stderr (proxycore/preload.py), so a record class dnspython would load
        # late shows below.
        [sys.executable, "-m", "proxycore.worker", "--config", str(config),
         "--control-fd", str(theirs.fileno()), "--drop-to", "65534:65534"],
        env=proxy_env(),
        pass_fds=[theirs.fileno()],
        stderr=subprocess.PIPE,
    )  # fmt: skip
    theirs.close()
    dns_port = free_port()
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((GATEWAY, port))
    listener.listen(8)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind((GATEWAY, dns_port))
    tcp = socket.socket()
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    tcp.bind((GATEWAY, dns_port))
    tcp.listen(8)
    try:
        ours.settimeout(10)
        # A message that announces DNS sockets and brings fewer is refused.
        short = request(
            ours, control.CrewAdd(name="alpha", gateway=GATEWAY, listener=True, dns=True),
            [listener],
        )  # fmt: skip
        assert not short["ok"] and "no listening socket" in short["error"]
        added = control.CrewAdd(
            name="alpha", gateway=GATEWAY, mode="restricted", listener=True, dns=True,
            ssrf_allow=("127.0.0.0/8",),
        )  # fmt: skip
        assert request(ours, added, [listener, udp, tcp]) == {"ok": True, "changed": True}
        for sock in (listener, udp, tcp):
            sock.close()  # the worker holds its own copies now

        # A provider host is in every crew's allowlist: its address from the proxy's own
        # resolve table, over UDP and TCP.
        host = "api.anthropic.test"
        assert addresses(ask_udp(dns_port, host, "A")) == {"127.0.0.1"}
        assert addresses(ask_tcp(dns_port, host, "A")) == {"127.0.0.1"}
        # Not allowed: NXDOMAIN; TXT: REFUSED.
        assert ask_udp(dns_port, "plain.test", "A").rcode() == dns.rcode.NXDOMAIN
        assert ask_udp(dns_port, host, "TXT").rcode() == dns.rcode.REFUSED
        # A hostile query carrying records of every type dnspython knows in its additional
        # section: answered (or refused) like any, and nothing imported after the drop.
        hostile = dns.message.make_query(host, "A")
        for kind in ("TXT", "MX", "HINFO", "SRV", "CAA", "NAPTR", "SSHFP", "TLSA", "LOC", "URI"):
            record = dns.rrset.from_text(
                "x.test.", 60, "IN", kind, EXAMPLE_RDATA.get(kind, "1 1 1")
            )
            hostile.additional.append(record)
        probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        probe.settimeout(5)
        probe.sendto(hostile.to_wire(), (GATEWAY, dns_port))
        reply = dns.message.from_wire(probe.recv(4096))
        probe.close()
        assert reply.rcode() in (dns.rcode.NOERROR, dns.rcode.FORMERR, dns.rcode.REFUSED)
        # The crew's own policy object: an allow at run time holds for the next query.
        assert request(ours, control.AllowHost(crew="alpha", host="plain.test"), []) == {
            "ok": True, "changed": True,
        }  # fmt: skip
        assert addresses(ask_udp(dns_port, "plain.test", "A")) == {"127.0.0.1"}

        # The refusals are events, for the journal.
        deadline = time.monotonic() + 5
        refused: list[DnsRefused] = []
        while time.monotonic() < deadline and len(refused) < 3:
            time.sleep(0.05)
            if events.exists():
                decoded = decode_events(events.read_bytes())
                refused = [e for e in decoded if isinstance(e, DnsRefused)]
        assert {(e.crew, e.name, e.qtype, e.rcode) for e in refused} == {
            ("alpha", "plain.test", "A", "NXDOMAIN"),
            ("alpha", host, "TXT", "REFUSED"),
            ("alpha", "", "", "FORMERR"),  # the hostile query: records where a query has none
        }

        # Removed: the sockets close (TCP refused, UDP unanswered), and the port is free.
        assert request(ours, control.CrewRemove(name="alpha"), []) == {"ok": True, "changed": True}
        # (The worker replies as it cancels the task; the sockets close a moment later.)
        deadline = time.monotonic() + 5
        while True:
            try:
                ask_tcp(dns_port, host, "A")
            except ConnectionRefusedError:
                break
            except ConnectionResetError:
                pass  # accepted into the backlog just before the close
            assert time.monotonic() < deadline, "the crew's DNS still answers over TCP"
            time.sleep(0.05)
        again = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        again.bind((GATEWAY, dns_port))
        again.close()
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
        shutil.rmtree(shared, ignore_errors=True)
    assert "Traceback" not in stderr, stderr
    assert "late import refused" not in stderr, stderr


def test_dns_refusals_are_journaled_one_entry_per_crew_and_batch() -> None:
    from appliance.journal import entries as E
    from appliance.journal.recorder import entries_for_batch
    from proxycore.protocol.events import PolicyWarning

    batch = [
        DnsRefused(ts=1.0, crew="a", name="x.test", qtype="A", rule="not_allowed",
                   rcode="NXDOMAIN"),
        PolicyWarning(ts=1.5, crew="a", message="m"),
        DnsRefused(ts=2.0, crew="b", name="y.test", qtype="TXT", rule="qtype", rcode="REFUSED"),
        DnsRefused(ts=3.0, crew="a", name="", qtype="A", rule="rate_limited_queries",
                   rcode="DROP", count=40),
    ]  # fmt: skip
    out = entries_for_batch(list(batch))
    assert [type(e).__name__ for e in out] == ["DnsRefused", "ProxyNotice", "DnsRefused"]
    first, _, second = out
    assert isinstance(first, E.DnsRefused) and isinstance(second, E.DnsRefused)
    assert first.crew == "a" and [q.name for q in first.queries] == ["x.test", ""]
    assert first.queries[1].count == 40
    assert "41 queries" in first.summary()
    assert second.summary() == "dns refused TXT y.test (qtype) -> REFUSED"
    assert E.decode(E.encode(first)) == first


def test_a_taken_dns_port_refuses_the_crew_instead_of_exposing_another_server() -> None:
    """Another DNS server on the gateway's port 53 would answer (and recurse for) the crew,
    whose rules let it reach that port: applianced refuses to serve the crew (fail closed),
    saying why, and leaves nothing bound."""
    import os

    import pytest

    from appliance.daemon.errors import Unavailable
    from appliance.daemon.proxy import ProxyPool

    if os.geteuid() != 0:
        pytest.skip("binding port 53 needs root")
    squatter = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    squatter.bind(("127.0.0.77", 53))
    try:
        with pytest.raises(Unavailable, match=r"127\.0\.0\.77:53.*\[net\] dns = false"):
            ProxyPool.bind_dns(None, "127.0.0.77")  # type: ignore[arg-type]
    finally:
        squatter.close()
    # With the port free again, both sockets bind (nothing was left half bound before).
    udp, tcp = ProxyPool.bind_dns(None, "127.0.0.77")  # type: ignore[arg-type]
    udp.close()
    tcp.close()
