"""json.dumps and json.loads for the `run` fast path, on CPython's C halves of the json module.

Why: `json` imports `re` and its compiler (~9 ms without site, docs/benchmarks.md); the fast
path (fast.py) reads and writes a few small documents, which `_json`'s scanner and string quoting
do byte for byte as the json module does (tests/test_cli.py holds them equal with hypothesis).
The project runs on CPython only (native/ is cffi).
"""

from _json import encode_basestring_ascii as quote
from _json import make_scanner as _make_scanner

TYPE_CHECKING = False  # typing's, without importing typing; mypy reads the name
if TYPE_CHECKING:
    from collections.abc import Mapping


def _value(value: object, comma: str = ", ") -> str:
    """json.dumps' text for the scalars and string lists appliancectl sends and prints."""
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if isinstance(value, str):
        return str(quote(value))
    if isinstance(value, int):
        return int.__repr__(value)
    if isinstance(value, float):
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    if isinstance(value, list | tuple):
        return "[" + comma.join(_value(item, comma) for item in value) + "]"
    raise TypeError(f"not sent as JSON here: {type(value).__name__}")


def dumps(data: "Mapping[str, object]", compact: bool = False) -> str:
    """json.dumps(data) for a flat object of the values above (the same bytes); with compact,
    json.dumps(data, separators=(",", ":"))."""
    comma, colon = (",", ":") if compact else (", ", ": ")
    return "{" + comma.join(f"{quote(k)}{colon}{_value(v, comma)}" for k, v in data.items()) + "}"


class _ScanContext:
    """What the C scanner reads of a json.JSONDecoder: json.loads' defaults."""

    strict = True
    object_hook = None
    object_pairs_hook = None
    parse_float = float
    parse_int = int

    @staticmethod
    def parse_constant(name: str) -> float:  # NaN, Infinity, -Infinity
        return float(name.lower().replace("infinity", "inf"))


# typeshed types the argument as the scanner class itself; the C code reads these attributes.
_scan = _make_scanner(_ScanContext())  # type: ignore[arg-type]


class NotJSON(ValueError):
    pass


def loads(data: bytes) -> object:
    """json.loads for one UTF-8 document."""
    try:
        text = data.decode("utf-8")
        start = len(text) - len(text.lstrip(" \t\r\n"))
        value, end = _scan(text, start)
    except (UnicodeDecodeError, StopIteration, ValueError) as exc:
        raise NotJSON(f"not JSON: {data[:200]!r} ({exc})") from None
    if text[end:].strip(" \t\r\n"):
        raise NotJSON(f"not one JSON value: {data[:200]!r}")
    return value
