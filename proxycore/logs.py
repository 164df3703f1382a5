"""Log records as operators read and ship them: one line each, text or JSON.

Theory of operation
-------------------
Both processes of the appliance log through the standard `logging` module; `configure()` puts
one handler on the root logger that writes one line per record to standard error:

    text  2025-06-01T12:00:00.123Z INFO applianced.api: admin client went away crew=demo
          request_id=9f0c...
    json  {"ts":"2025-06-01T12:00:00.123Z","level":"info","logger":"applianced.api",
           "msg":"admin client went away","pid":41,"crew":"demo","request_id":"9f0c..."}

Every record has its time (RFC 3339, UTC, milliseconds), its level, its component (the logger's
name) and, where one applies, the fields of `FIELDS`: the crew, the request id (an admin
request's, which is a run's journal trace id), the proxy worker. A field comes from the call
(`log.info(..., extra={"crew": name})`) or from the task's context (`bound(crew=...)`: a
contextvar, so each trio task carries its own and a child task inherits its parent's).

One line per record, always: a message or an exception's traceback that holds a line break is
written with it escaped (`\\n`), so that grep and a line-oriented shipper see whole records and
nobody can forge a record by putting a line break in a crew's upstream's words. In JSON the
traceback is the string field `exc`.

The proxy workers log the same way, in JSON, to their standard error, which applianced reads:
it decodes each line, scrubs it, and logs it again as a record of its own (same time, level,
component and fields, plus the worker's index), so the operator sees one stream in the format
they chose (appliance/logs.py).

Why a formatter of our own rather than python-json-logger: the worker imports nothing after it
drops its privileges (proxycore/preload.py) and keeps its dependencies to the data plane's; the
JSON is one msgspec call (already loaded by both processes) and the text form had to be written
anyway. This module imports only what both processes load at start.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import os
import sys
import time
import types
from collections.abc import Iterator, Mapping
from types import TracebackType
from typing import IO, Any

import msgspec

FORMATS = ("text", "json")
LEVELS = ("debug", "info", "warning", "error")
# The structured fields a record may carry (from `extra=` or the task's context), in the order
# the text form writes them.
FIELDS = ("crew", "request_id", "worker", "worker_pid")

_NO_FIELDS: Mapping[str, Any] = types.MappingProxyType({})
_context: contextvars.ContextVar[Mapping[str, Any]] = contextvars.ContextVar(
    "appliance_log_context", default=_NO_FIELDS
)
_encode = msgspec.json.Encoder().encode


@contextlib.contextmanager
def bound(**fields: Any) -> Iterator[None]:
    """Records logged inside the block (by this task and the tasks it starts) carry `fields`;
    a None value is left out."""
    token = _context.set({**_context.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _context.reset(token)


def context_value(name: str) -> Any:
    """A field bound by `bound()` in this task, or None."""
    return _context.get().get(name)


def rfc3339(created: float) -> str:
    """2025-06-01T12:00:00.123Z: UTC, millisecond precision (RFC 3339 section 5.6)."""
    millis = int(created * 1000) % 1000
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(created)) + f".{millis:03d}Z"


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    context = _context.get()
    out: dict[str, Any] = {}
    for name in FIELDS:
        value = record.__dict__.get(name)
        if value is None:
            value = context.get(name)
        if value is not None:
            out[name] = value
    return out


def _exception_text(formatter: logging.Formatter, record: logging.LogRecord) -> str | None:
    """The record's traceback: of its exc_info, or one given already formatted (and scrubbed)
    as `extra={"trace": text}`."""
    if record.exc_info and not record.exc_text:
        record.exc_text = formatter.formatException(record.exc_info)
    trace = record.exc_text or record.__dict__.get("trace")
    return str(trace) if trace else None


def _one_line(text: str) -> str:
    if "\n" in text or "\r" in text:
        return text.replace("\r", "\\r").replace("\n", "\\n")
    return text


def _text_value(value: Any) -> str:
    """A field's value as logfmt writes it: bare, or quoted with \\, \", \\n, \\r escaped."""
    text = str(value)
    if text and not any(c in text for c in ' ="\\\n\r'):
        return text
    escaped = text.replace("\\", "\\\\").replace('"', '\\"')
    return '"' + escaped.replace("\r", "\\r").replace("\n", "\\n") + '"'


class TextFormatter(logging.Formatter):
    """`<time> <LEVEL> <component>: <message> key=value...`, one line."""

    def format(self, record: logging.LogRecord) -> str:
        parts = [
            rfc3339(record.created),
            record.levelname,
            f"{record.name}: {_one_line(record.getMessage())}",
        ]
        parts += [f"{key}={_text_value(value)}" for key, value in _fields(record).items()]
        exc = _exception_text(self, record)
        if exc is not None:
            parts.append(f"exc={_text_value(exc)}")
        return " ".join(parts)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, pid, the fields that apply, exc."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": rfc3339(record.created),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            "pid": record.process,
        }
        out.update(_fields(record))
        exc = _exception_text(self, record)
        if exc is not None:
            out["exc"] = exc
        return _encode(out).decode("utf-8", "replace")


def formatter(kind: str) -> logging.Formatter:
    if kind == "json":
        return JsonFormatter()
    if kind == "text":
        return TextFormatter()
    raise ValueError(f"log format {kind!r}: not one of {', '.join(FORMATS)}")


def level_number(name: str) -> int:
    if name.lower() not in LEVELS:
        raise ValueError(f"log level {name!r}: not one of {', '.join(LEVELS)}")
    number: int = logging.getLevelName(name.upper())
    return number


class _StaticFields(logging.Filter):
    """Adds this process's fixed fields (a worker's index) to every record without them."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        super().__init__()
        self.fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self.fields.items():
            if record.__dict__.get(key) is None:
                setattr(record, key, value)
        return True


def configure(
    kind: str = "text",
    level: str = "info",
    *,
    stream: IO[str] | None = None,
    fields: Mapping[str, Any] | None = None,
    excepthook: str | None = None,
) -> logging.Handler:
    """The root logger writes one line per record to `stream` (standard error) in `kind`
    ("text" or "json") from `level` up; `fields` go on every record (the worker's index).
    With `excepthook` (a component's name), an exception nobody caught is logged as one record
    of that component (CRITICAL) rather than printed as a many-line traceback."""
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(formatter(kind))
    if fields:
        handler.addFilter(_StaticFields(fields))
    root = logging.getLogger()
    for old in root.handlers[:]:
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)
    root.setLevel(level_number(level))
    if excepthook is not None:
        sys.excepthook = functools.partial(_log_uncaught, logging.getLogger(excepthook))
    return handler


def _log_uncaught(
    logger: logging.Logger,
    kind: type[BaseException],
    value: BaseException,
    tb: TracebackType | None,
) -> None:
    if issubclass(kind, KeyboardInterrupt):
        sys.__excepthook__(kind, value, tb)
        return
    logger.critical(
        "uncaught %s: %s (pid %d exits)",
        kind.__name__,
        value,
        os.getpid(),
        exc_info=(kind, value, tb),
    )
