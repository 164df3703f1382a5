"""Fuzz the method and path rules (proxycore/protocol/l7.py) against their invariants.

Run:  python fuzz/fuzz_l7.py -runs=300000
(atheris is imported only in `main`; tests/test_fuzz_l7.py replays `SEEDS` without it.)

The input is a request-target (and, after a NUL, a method). Invariants, on every input:
- `L7Rules.check` never raises; `canonical_path` raises nothing but `NotCanonical`, and its
  output is a fixed point of itself.
- Nothing allowed escapes its rule: a path allowed under `/safe/**` still names `/safe` or a path
  below it under every reading a server has been seen to apply (decoded once or twice,
  backslashes as slashes, `;params` dropped, NFKC-folded, slashes merged, dot-segments removed,
  RFC 3986 5.2.4). The same for `/api/*/items` (one segment, then `items`).
- Methods are exact: a rule with the read-only preset allows nothing but GET, HEAD, OPTIONS.
- A refusal names one of the four rules and gives a message.
"""

from __future__ import annotations

import re
import sys
import unicodedata
import urllib.parse
from pathlib import Path

if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from proxycore.protocol.l7 import (
    READ_ONLY_METHODS,
    RULE_METHOD,
    RULE_NOT_CANONICAL,
    RULE_PATH,
    HostRule,
    L7Rules,
    NotCanonical,
    canonical_path,
)

HOST = "fuzz.test"
RULES = L7Rules(
    [
        HostRule.make(HOST, preset="read-only", paths=["/safe/**"]),
        HostRule.make(HOST, preset="read-only", paths=["/api/*/items"]),
    ]
)
_RULES = {RULE_METHOD, RULE_PATH, RULE_NOT_CANONICAL}


def readings(path: bytes) -> set[str]:
    """Every path a server may route `path` to (see the module docstring)."""
    out = set()
    text = path.decode("latin-1")
    for decodes in range(3):
        decoded = text
        for _ in range(decodes):
            decoded = urllib.parse.unquote(decoded, errors="replace")
        for variant in (decoded, unicodedata.normalize("NFKC", decoded)):
            variant = variant.replace("\\", "/")
            variant = "/".join(segment.split(";", 1)[0] for segment in variant.split("/"))
            variant = re.sub("/+", "/", variant)
            out.add(remove_dot_segments(variant))
    return out


def remove_dot_segments(path: str) -> str:
    kept: list[str] = []
    for segment in path.split("/")[1:]:
        if segment == "..":
            if kept:
                kept.pop()
        elif segment != ".":
            kept.append(segment)
    return "/" + "/".join(kept)


def _under_its_rule(reading: str) -> bool:
    if reading == "/safe" or reading.startswith("/safe/"):
        return True
    parts = reading.split("/")
    return len(parts) == 4 and parts[1] == "api" and parts[2] != "" and parts[3] == "items"


def TestOneInput(data: bytes) -> None:
    target, _, method = data.partition(b"\x00")
    method = method[:16] or b"GET"
    try:
        once = canonical_path(target)
    except NotCanonical:
        pass
    else:
        assert canonical_path(once) == once, (target, once)
    denied = RULES.check(HOST, method, target)
    if denied is not None:
        assert denied.rule in _RULES and denied.message, denied
        return
    assert method.decode("latin-1") in READ_ONLY_METHODS, method
    path = target.split(b"?", 1)[0]
    for reading in readings(path):
        assert _under_its_rule(reading), (target, reading)


SEEDS = [
    b"/safe/x",
    b"/safe/../admin",
    b"/safe/%2e%2e/admin",
    b"/safe%2F..%2Fadmin",
    b"/safe/..;/admin",
    b"/safe/%252e%252e/admin",
    b"/safe/%C0%AE%C0%AE/admin",
    b"/safe/%EF%BC%8E%EF%BC%8E/admin",
    b"/safe/..\\admin",
    b"/safe//../admin",
    b"/api/x/items",
    b"/api/x/items\x00DELETE",
    b"/api/../items",
    b"/api/%2e/items",
    b"/api/x;/../y/items",
    b"/safe?x=/../admin",
    b"/safe/x#/../admin",
    b"/safe/x\x00get",
]


def main() -> None:
    from seeded import fuzz

    fuzz("l7", SEEDS, TestOneInput)


if __name__ == "__main__":
    main()
