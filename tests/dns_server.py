"""A scripted DNS server for tests (run as a program inside a test network namespace).

    python tests/dns_server.py ADDRESS PORT PLAN.json LOG

PLAN maps a name to what its A queries get, in order: a list of answer lists, the last one
repeated ("rebind.test": [["1.1.2.2"], ["1.1.2.3"]] answers the first A query with 1.1.2.2 and
every later one with 1.1.2.3); "silent" instead of a list means never answer. AAAA queries get
an empty answer unless PLAN has "name/AAAA". Unknown names get NXDOMAIN. Every query is
appended to LOG as "NAME TYPE N TIME" (N: the how-many-th query of that name and type; TIME:
seconds, monotonic clock). Messages
are read and written with dnspython, not by hand.
"""

from __future__ import annotations

import json
import socket
import sys
import time

import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.rrset


def main() -> None:
    address, port, plan_path, log_path = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    with open(plan_path) as file:
        plan: dict[str, object] = json.load(file)
    counts: dict[tuple[str, str], int] = {}
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_DGRAM)
    sock.bind((address, port))
    print("ready", flush=True)
    while True:
        data, peer = sock.recvfrom(65535)
        try:
            query = dns.message.from_wire(data)
        except Exception:  # a test server: a malformed query is dropped
            continue
        question = query.question[0]
        name = question.name.to_text(omit_final_dot=True).lower()
        kind = dns.rdatatype.to_text(question.rdtype)
        n = counts[(name, kind)] = counts.get((name, kind), 0) + 1
        with open(log_path, "a") as log:
            log.write(f"{name} {kind} {n} {time.monotonic():.3f}\n")
        key = name if kind == "A" else f"{name}/{kind}"
        script = plan.get(key, plan.get(name) if kind != "A" else None)
        if script == "silent" or plan.get(name) == "silent":
            continue
        response = dns.message.make_response(query)
        response.flags |= dns.flags.RA
        if name not in plan:
            response.set_rcode(dns.rcode.NXDOMAIN)
        elif kind == "A" or key in plan:
            assert isinstance(script, list)
            answers = script[min(n, len(script)) - 1]
            if answers:
                response.answer.append(
                    dns.rrset.from_text_list(question.name, 0, "IN", kind, answers)
                )
        sock.sendto(response.to_wire(), peer)


if __name__ == "__main__":
    main()
