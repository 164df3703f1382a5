"""applianced's logs: its own records, and its proxy workers' lines written again as records.

Theory of operation
-------------------
The format is proxycore/logs.py's (both processes share it): one line per record, `text` (the
default) or `json`, chosen by `[daemon] log_format` / `log_level` or `appliancectl up
--log-format/--log-level` (`setup()`).

A proxy worker logs JSON on its standard error, which is a pipe to applianced
(appliance/daemon/supervisor.py `StderrTail`). `WorkerLog.emit` takes each line:

- a JSON record (what the worker's logging writes) is decoded, every string in it scrubbed, and
  logged again here as a record of the worker's: its own time, level, component and fields, plus
  `worker` and `worker_pid` (applianced's word, not the worker's). In JSON mode the operator
  reads the same object the worker wrote (never one JSON line quoted inside another); in text
  mode the same line as applianced's own.
- any other line (a late-import refusal, what a dying interpreter prints) is one WARNING record
  of `proxycore.worker` holding the scrubbed line.

Scrubbing after decoding, not before: a secret holding a quote or a backslash is escaped in the
JSON text and would not match there. A worker runs unprivileged and parses the crews' bytes, so
what it writes is bounded here: component names are checked, strings are cut at MAX_FIELD.
"""

from __future__ import annotations

import datetime
import logging
import re
import time
from collections.abc import Callable
from typing import Any

import msgspec

from proxycore import logs

__all__ = ["WorkerLog", "setup"]

WORKER_COMPONENT = "proxycore.worker"
MAX_FIELD = 16 * 1024
_COMPONENT = re.compile(r"[A-Za-z0-9_.-]{1,64}")
_LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
}


def setup(kind: str = "text", level: str = "info") -> None:
    """applianced's logging: every record one line on standard error (proxycore/logs.py)."""
    logs.configure(kind, level, excepthook="applianced")


def worker_level() -> str:
    """The level the workers log at: applianced's own, but never above INFO, since the tail of
    a worker's lines (its last words in `status` and the journal) keeps what applianced's
    level leaves out of its log (its start-up lines)."""
    level = min(logging.getLogger().getEffectiveLevel(), logging.INFO)
    return "debug" if level <= logging.DEBUG else "info"


class WorkerLog:
    """One worker life's standard error, line by line, as applianced's log records."""

    def __init__(self, worker: int, pid: int, scrub: Callable[[str], str]) -> None:
        self.worker = worker
        self.pid = pid
        self.scrub = scrub

    def emit(self, line: str, *, cut: bool = False) -> str:
        """Log one line (unscrubbed, as read); returns its scrubbed text for the tail."""
        decoded = None if cut or not line.startswith("{") else _decode(line)
        if decoded is None:
            text = self.scrub(line) + ("..." if cut else "")
            self._log(WORKER_COMPONENT, logging.WARNING, text, time.time(), {})
            return text
        fields = {
            key: self._clean(value)
            for key, value in decoded.items()
            if key in ("crew", "request_id") and isinstance(value, str)
        }
        message = self._clean(decoded.get("msg", ""))
        component = decoded.get("logger")
        if not isinstance(component, str) or not _COMPONENT.fullmatch(component):
            component = WORKER_COMPONENT
        level = _LEVELS.get(str(decoded.get("level")), logging.WARNING)
        exc = decoded.get("exc")
        if isinstance(exc, str):
            fields["exc_text"] = self._clean(exc)
        self._log(component, level, message, _timestamp(decoded.get("ts")), fields)
        return message

    def _clean(self, value: Any) -> str:
        text = value if isinstance(value, str) else str(value)
        if len(text) > MAX_FIELD:
            text = text[:MAX_FIELD] + "..."
        return self.scrub(text)

    def _log(
        self, component: str, level: int, message: str, created: float, fields: dict[str, Any]
    ) -> None:
        logger = logging.getLogger(component)
        if not logger.isEnabledFor(level):
            return
        record = logging.makeLogRecord(
            {
                "name": component,
                "levelno": level,
                "levelname": logging.getLevelName(level),
                "msg": message,
                "args": None,
                "created": created,
                "msecs": (created % 1) * 1000,
                "process": self.pid,
                "worker": self.worker,
                "worker_pid": self.pid,
                **fields,
            }
        )
        logger.handle(record)


def _decode(line: str) -> dict[str, Any] | None:
    try:
        value = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("msg"), str):
        return None
    return value


def _timestamp(value: Any) -> float:
    if isinstance(value, str):
        try:
            return datetime.datetime.fromisoformat(value).timestamp()
        except ValueError:
            pass
    return time.time()
