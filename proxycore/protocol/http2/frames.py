"""HTTP/2 frames on the wire (RFC 9113 4, 6): the numbers, and our own frames as bytes.

The frame layer of `endpoint.H2Endpoint`: the 9-octet frame header (length, type, flags, stream
identifier), the error codes of RFC 9113 7, the setting identifiers of 6.5.2, and the frames we
send, each built by one function. Parsing a received frame's payload is the endpoint's, next to
the checks RFC 9113 asks of each type.
"""

from __future__ import annotations

import enum
import struct

__all__ = [
    "CONTINUATION",
    "DATA",
    "FRAME_HEADER",
    "GOAWAY",
    "HEADERS",
    "PING",
    "PRIORITY",
    "PUSH_PROMISE",
    "RST_STREAM",
    "SETTINGS",
    "WINDOW_UPDATE",
    "ErrorCode",
    "Setting",
    "data_frame",
    "frame",
    "goaway_frame",
    "header_frames",
    "rst_stream_frame",
    "settings_frame",
    "window_update_frame",
]

# RFC 9113 6: frame types.
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS = 0x0, 0x1, 0x2, 0x3, 0x4
PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = 0x5, 0x6, 0x7, 0x8, 0x9

# Flags (RFC 9113 6.1, 6.2, 6.5, 6.7).
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# RFC 9113 5.1.1, 6.9.1: stream identifiers and flow-control windows are 31-bit.
MAX_WINDOW = 2**31 - 1
# RFC 9113 6.5.2: the initial flow-control window and frame size until SETTINGS say otherwise.
DEFAULT_WINDOW = 65535
DEFAULT_FRAME_SIZE = 16384
MAX_FRAME_SIZE_LIMIT = 2**24 - 1


class ErrorCode(enum.IntEnum):
    """RFC 9113 7: the error codes of RST_STREAM and GOAWAY."""

    NO_ERROR = 0x0
    PROTOCOL_ERROR = 0x1
    INTERNAL_ERROR = 0x2
    FLOW_CONTROL_ERROR = 0x3
    SETTINGS_TIMEOUT = 0x4
    STREAM_CLOSED = 0x5
    FRAME_SIZE_ERROR = 0x6
    REFUSED_STREAM = 0x7
    CANCEL = 0x8
    COMPRESSION_ERROR = 0x9
    CONNECT_ERROR = 0xA
    ENHANCE_YOUR_CALM = 0xB
    INADEQUATE_SECURITY = 0xC
    HTTP_1_1_REQUIRED = 0xD


class Setting(enum.IntEnum):
    """RFC 9113 6.5.2 setting identifiers, and RFC 8441 3's."""

    HEADER_TABLE_SIZE = 0x1
    ENABLE_PUSH = 0x2
    MAX_CONCURRENT_STREAMS = 0x3
    INITIAL_WINDOW_SIZE = 0x4
    MAX_FRAME_SIZE = 0x5
    MAX_HEADER_LIST_SIZE = 0x6
    ENABLE_CONNECT_PROTOCOL = 0x8


# The 9-octet frame header (RFC 9113 4.1): the 24-bit length as its high 16 bits and its low 8,
# type, flags, and the reserved bit with the 31-bit stream identifier. One struct call packs or
# reads it (a frame or two per stream each way: building it from bytes() and int.to_bytes, or
# reading it octet by octet, cost more than the rest of a small frame).
FRAME_HEADER = struct.Struct(">HBBBL")
_pack_header = FRAME_HEADER.pack


def frame(kind: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    """One frame: the 9-octet header (RFC 9113 4.1) and its payload."""
    length = len(payload)
    return _pack_header(length >> 8, length & 0xFF, kind, flags, stream_id) + payload


def data_frame(stream_id: int, data: bytes, *, end: bool) -> bytes:
    return frame(DATA, END_STREAM if end else 0, stream_id, data)


def header_frames(stream_id: int, block: bytes, *, end: bool, max_frame_size: int) -> bytes:
    """A header block as HEADERS and, past the peer's SETTINGS_MAX_FRAME_SIZE, CONTINUATION
    frames (RFC 9113 6.2, 6.10)."""
    flags = END_STREAM if end else 0
    if len(block) <= max_frame_size:
        return frame(HEADERS, flags | END_HEADERS, stream_id, block)
    pieces = [block[i : i + max_frame_size] for i in range(0, len(block), max_frame_size)]
    out = [frame(HEADERS, flags, stream_id, pieces[0])]
    for piece in pieces[1:-1]:
        out.append(frame(CONTINUATION, 0, stream_id, piece))
    out.append(frame(CONTINUATION, END_HEADERS, stream_id, pieces[-1]))
    return b"".join(out)


def rst_stream_frame(stream_id: int, code: int) -> bytes:
    return frame(RST_STREAM, 0, stream_id, int(code).to_bytes(4, "big"))


def window_update_frame(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, increment.to_bytes(4, "big"))


def settings_frame(settings: dict[Setting, int]) -> bytes:
    payload = b"".join(
        int(code).to_bytes(2, "big") + value.to_bytes(4, "big") for code, value in settings.items()
    )
    return frame(SETTINGS, 0, 0, payload)


def goaway_frame(last_stream_id: int, code: int) -> bytes:
    return frame(GOAWAY, 0, 0, last_stream_id.to_bytes(4, "big") + int(code).to_bytes(4, "big"))
