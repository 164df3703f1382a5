"""Build the native modules in place: `python -m native.build [--sanitize]`.

`pip install .` builds them through setup.py; a source checkout (the Makefile, CI) uses this.
`--sanitize` builds them in place with AddressSanitizer and UndefinedBehaviorSanitizer, for
`make native-sanitize` (which runs the tests on them with the sanitizer runtimes preloaded, then
rebuilds them normally: a sanitized module does not load without that preload).
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cffi import FFI

from native import _build_headscan, _build_scrub

ROOT = Path(__file__).resolve().parent.parent
SANITIZE = [
    "-fsanitize=address,undefined",
    "-fno-sanitize-recover=all",
    "-fno-omit-frame-pointer",
    "-g",
    "-O1",
]


# (module name, its build script): every native module. The scrubber's stage 2 (fold.c) is
# compiled into _scrub (see _build_scrub.py); a `_fold` module left by an older build is removed.
MODULES = (("_headscan", _build_headscan), ("_scrub", _build_scrub))
RETIRED = ("_fold",)


def build(out_dir: Path, extra_cflags: list[str] | None = None) -> list[Path]:
    """Compile every native module; the extensions land in out_dir/native/."""
    built = [_build_one(name, script.make_ffi(extra_cflags), out_dir) for name, script in MODULES]
    for name in RETIRED:
        for stale in (out_dir / "native").glob(f"{name}.*so"):
            stale.unlink()
    return built


def _build_one(name: str, ffi: FFI, out_dir: Path) -> Path:
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(ROOT)
        try:
            built = Path(ffi.compile(tmpdir=tmp, verbose=False))
        finally:
            os.chdir(cwd)
        target = out_dir / "native" / built.name
        target.parent.mkdir(parents=True, exist_ok=True)
        # One build per module: an older one under another suffix (an editable install
        # leaves `.abi3.so`) could shadow or be shadowed by this one.
        for stale in target.parent.glob(f"{name}.*so"):
            stale.unlink()
        shutil.copy2(built, target)
    return target


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--sanitize", action="store_true", help="build with ASan + UBSan (see module docstring)"
    )
    args = parser.parse_args()
    try:
        paths = build(ROOT, SANITIZE if args.sanitize else None)
    except Exception as exc:  # a compiler error: say so, the reference implementations remain
        print(f"native: build failed: {exc}", file=sys.stderr)
        return 1
    for path in paths:
        print(f"native: built {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
