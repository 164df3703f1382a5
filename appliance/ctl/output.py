"""Output formats: data on stdout in the format asked for, errors on stderr, always.

    -o table   (default) aligned columns or `key: value` lines, for people
    -o wide    the table with every column (ids, addresses, limits)
    -o json    one JSON document (`--json` is an alias); a stream prints one per line
    -o yaml    the same document as YAML
    -o name    only the names, one per line (`for c in $(appliancectl crew ls -o name)`)

An error is one line `appliancectl: error: MESSAGE` on stderr, or with -o json/yaml a JSON
object `{"ok": false, "error", "kind", "exit_code"}` on stderr: a script reading stdout never
mistakes an error for data (docs/cli.md).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterable
from typing import Any

FORMATS = ("table", "wide", "json", "yaml", "name")


def builtins(data: Any) -> Any:
    """Structs (messages.py) and tuples as plain JSON values."""
    if isinstance(data, dict | list | str | int | float | bool) or data is None:
        if isinstance(data, dict):
            return {k: builtins(v) for k, v in data.items()}
        if isinstance(data, list):
            return [builtins(v) for v in data]
        return data
    import msgspec

    return msgspec.to_builtins(data)


class Output:
    def __init__(self, format: str = "table") -> None:
        self.format = format

    @property
    def as_json(self) -> bool:
        """A machine format: errors as JSON on stderr too."""
        return self.format in ("json", "yaml")

    @property
    def wide(self) -> bool:
        return self.format == "wide"

    def emit(
        self,
        data: Any,
        human: str | Callable[[bool], str],
        names: Iterable[str] = (),
    ) -> None:
        """One result: `data` (a dict or Struct) as json/yaml, the names with -o name, else the
        text `human` (or human(wide))."""
        if self.format == "json":
            text = json.dumps(builtins(data))
        elif self.format == "yaml":
            text = to_yaml(builtins(data)).rstrip("\n")
        elif self.format == "name":
            text = "\n".join(names)
        else:
            text = human if isinstance(human, str) else human(self.wide)
        if text:
            print(text, flush=True)

    def error(self, message: str, code: int, *, kind: str | None = None) -> int:
        if self.as_json:
            data: dict[str, Any] = {"ok": False, "error": message, "exit_code": code}
            if kind is not None:
                data["kind"] = kind
            print(json.dumps(data), file=sys.stderr, flush=True)
        else:
            print(f"appliancectl: error: {message}", file=sys.stderr, flush=True)
        return code

    def warning(self, message: str) -> None:
        print(f"appliancectl: warning: {message}", file=sys.stderr, flush=True)


def to_yaml(data: Any) -> str:
    import yaml

    return str(yaml.safe_dump(data, sort_keys=False, default_flow_style=False, allow_unicode=True))


def table(header: list[str], rows: Iterable[list[str]]) -> str:
    """Columns as wide as their widest cell, two spaces apart (as kubectl and docker print)."""
    rows = [header, *rows]
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip()
        for row in rows
    )


def clock(ts: float | None) -> str:
    import time

    if ts is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ts))


def watch(render: Callable[[], int], interval: float, out: Output) -> int:
    """`--watch`: render again every `interval` seconds until Ctrl-C (exit 130, main.py). On a
    terminal in a table format the screen is cleared first (as watch(1)); otherwise each
    rendering follows the last (with -o json, one document per line)."""
    import time

    clear = sys.stdout.isatty() and not out.as_json and out.format != "name"
    while True:
        if clear:
            sys.stdout.write("\x1b[H\x1b[2J")
            sys.stdout.flush()
        render()
        time.sleep(interval)
