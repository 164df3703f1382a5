"""The relay fast path: header lines forwarded as they arrived, minus the ones we drop.

Parsing a head into tuples, stripping and re-serializing it costs more than the rest of a forward
exchange. A head that `parse_*_head` accepted is already known to be clean: CRLF line endings, no
obs-fold, token names directly followed by ":", no CR, LF or NUL in values. So its field block
can be forwarded as bytes, with the dropped fields cut out in C (native/src/headscan.c) or by one
regex pass. `relay_fields` is equivalent to `strip_hop_by_hop` (tests/test_http1_relay.py holds
the two to each other); when a Connection field nominates other fields it returns None and the
caller takes the general path.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from native import headscan as _native
from proxycore.protocol.http1.grammar import HOP_BY_HOP
from proxycore.protocol.http1.heads import RequestHead, ResponseHead

__all__ = [
    "RESPONSE_DROP",
    "DropSet",
    "compile_drop",
    "reference_relay_fields",
    "relay_fields",
]


class DropSet:
    """Field names `relay_fields` cuts out: a regex for the reference path, a mask for C.

    Unless `keep_underscores`, every field whose name holds "_" is cut out too (see
    `serialize.strip_hop_by_hop`, which does the same on the general path).
    """

    __slots__ = ("keep_underscores", "mask", "names", "pattern")

    def __init__(self, names: Iterable[bytes], *, keep_underscores: bool = False) -> None:
        self.names = frozenset(name.lower() for name in names)
        self.keep_underscores = keep_underscores
        alternatives = [re.escape(name) for name in sorted(self.names, key=len, reverse=True)]
        if not keep_underscores:
            # A name holding "_" (an accepted head's names are tokens, directly before ":").
            alternatives.append(rb"[^:\r_]*+_[^:\r]*+")
        # Whole field lines (with their leading CRLF) of the given names.
        self.pattern = re.compile(
            rb"\r\n(?:" + b"|".join(alternatives) + rb"):[^\r]*", re.IGNORECASE
        )
        # None when a name is beyond what the C relay knows: the regex serves.
        self.mask = (
            _native.drop_mask(self.names, underscores=not keep_underscores)
            if _native.AVAILABLE
            else None
        )


def compile_drop(names: Iterable[bytes], *, keep_underscores: bool = False) -> DropSet:
    """The drop set for `relay_fields` of these field names (case-insensitive), and of every
    name holding an underscore unless `keep_underscores` (responses: see `RESPONSE_DROP`)."""
    return DropSet(names, keep_underscores=keep_underscores)


# Responses keep their underscored fields: the "_" to "-" mapping that makes them dangerous is a
# server's (CGI-style environments read request fields); the agent's HTTP clients have no such
# mapping, and nginx and Envoy apply their underscore rules to requests only.
RESPONSE_DROP = compile_drop(HOP_BY_HOP, keep_underscores=True)


def relay_fields(head: RequestHead | ResponseHead, drop: DropSet) -> bytes | None:
    """The field lines of a parsed head minus those in `drop`, each led by CRLF.

    The caller writes: start line + result + its own `\r\nname: value` lines + CRLF CRLF.

    The result holds neither the start line nor the final blank line. None when a Connection
    field names a field beyond close/keep-alive and the hop-by-hop set (`head.nominates`).
    """
    if drop.mask is not None and not head.nominates:
        fields = _native.relay_fields(head.raw, head.start_len, drop.mask)
        if fields is not None:
            return fields
    return reference_relay_fields(head, drop)


def reference_relay_fields(head: RequestHead | ResponseHead, drop: DropSet) -> bytes | None:
    """`relay_fields` by regex alone: the behaviour the C relay is held to."""
    if head.nominates:
        return None
    raw = head.raw
    return drop.pattern.sub(b"", raw[head.start_len : len(raw) - 4])
