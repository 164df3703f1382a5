"""The steps of scripts/install that need the project: run by the venv's Python.

    install_helper.py engine   dockerd answering, runsc registered (appliance.runtime.engine)
    install_helper.py images   the base, infra and agent images (images.build)

Progress goes to stdout as `install: ...` lines. Whatever goes wrong ends in one line on stderr
saying what and what to do, and exit status 1: never a traceback (the script's promise).
"""

from __future__ import annotations

import os
import sys
import time


def say(message: str) -> None:
    print(f"install: {message}", flush=True)


def engine() -> None:
    from appliance.runtime.engine import DOCKERD_LOG, RUNSC_PATH, ensure_dockerd

    began = time.monotonic()
    client = ensure_dockerd(wait=60.0)
    info = client.info()
    runtimes = sorted(info.get("Runtimes") or {})
    runsc = (
        "runsc registered (--network=host)"
        if "runsc" in runtimes
        else "runsc not installed: crews run under runc only"
        if not os.access(RUNSC_PATH, os.X_OK)
        else "runsc installed but not registered"
    )
    say(
        f"engine: dockerd {info.get('ServerVersion')} answers ({time.monotonic() - began:.1f} s; "
        f"storage {info.get('Driver')}; {runsc}; its log: {DOCKERD_LOG} when started here)"
    )


def images() -> None:
    from images.build import ensure_images

    began = time.monotonic()
    built = ensure_images(log=lambda message: say(f"images: {message}"))
    say(
        f"images: agent {built.agent}, infra {built.infra} "
        f"({time.monotonic() - began:.1f} s; built locally, never pulled)"
    )


def main(argv: list[str]) -> int:
    steps = {"engine": engine, "images": images}
    if len(argv) != 1 or argv[0] not in steps:
        print(f"usage: install_helper.py {{{','.join(steps)}}}", file=sys.stderr)
        return 2
    try:
        steps[argv[0]]()
    except KeyboardInterrupt:
        print("install: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # the one readable line, whatever the library raised
        hint = {
            "engine": "is dockerd installed and allowed to start here? (apt-get install "
            "docker.io; /var/log/dockerd.log says why it stopped)",
            "images": "the build reaches Debian's archive (debootstrap) and npm's registry; "
            "python -m images.build shows the whole build",
        }[argv[0]]
        reason = " ".join(str(exc).split()) or type(exc).__name__
        print(f"install: {argv[0]}: {reason[:300]}: {hint}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
