"""The field grammar an HTTP/2 message holds to (RFC 9113 8.2), in one place for every check of
it: requests from agents (messages.py), our responses (connection.py), requests to upstreams
(client.py), upstreams' responses (outbound.py) and trailers either way (../trailers.py)."""

from __future__ import annotations

import re

from proxycore.protocol.credentials import CREDENTIAL_HEADERS

__all__ = ["CONNECTION_SPECIFIC", "FIELD_NAME", "FIELD_VALUE", "well_formed"]

# Field names: tokens in lowercase (RFC 9113 8.2.1).
FIELD_NAME = re.compile(rb"[-!#$%&'*+.^_`|~0-9a-z]+")
# Field values: VCHAR, obs-text, SP and HTAB inside (RFC 9110 5.5); no leading or trailing
# whitespace (RFC 9113 8.2.1).
FIELD_VALUE = re.compile(
    rb"(?:[\x21-\x7e\x80-\xff](?:[\t\x20-\x7e\x80-\xff]*[\x21-\x7e\x80-\xff])?)?"
)
# RFC 9113 8.2.2: connection-specific fields never go into an HTTP/2 message (TE only as
# "trailers", which each caller checks where it may appear).
CONNECTION_SPECIFIC = frozenset(
    {b"connection", b"keep-alive", b"proxy-connection", b"transfer-encoding", b"upgrade"}
)


# The answers of `well_formed` for the fields that come again and again (content-type, server,
# user-agent...): one bounded dict for the process, emptied when full. Long values are checked
# each time, and the fields that carry secrets are never kept (as in hpack_out.py).
_CHECKED_LIMIT = 1024
_CHECKED_VALUE_BYTES = 128
_NEVER_KEPT = CREDENTIAL_HEADERS | {b"cookie", b"set-cookie"}
_checked: dict[tuple[bytes, bytes], bool] = {}


def well_formed(name: bytes, value: bytes) -> bool:
    """A field an HTTP/2 message may carry by the grammar (RFC 9113 8.2.1)."""
    key = (name, value)
    known = _checked.get(key)
    if known is not None:
        return known
    good = FIELD_NAME.fullmatch(name) is not None and FIELD_VALUE.fullmatch(value) is not None
    if len(value) <= _CHECKED_VALUE_BYTES and name not in _NEVER_KEPT:
        if len(_checked) >= _CHECKED_LIMIT:
            _checked.clear()
        _checked[key] = good
    return good
