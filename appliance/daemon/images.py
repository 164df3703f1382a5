"""The agent and infra images applianced runs crews from: configured tags, or built by images/.

Theory of operation
-------------------
Building an image (images/build.py) is the one thing applianced does that needs the whole of
root: debootstrap creates device nodes and set-user-ID files, every chroot runs under `unshare
--mount --pid` with its own /proc, and the cache lives under /var/cache. Serving crews needs far
less (docs/systemd.md). So the unit runs the build as a step of its own before the daemon,
`applianced --build-images` in `ExecStartPre=+...` (the "+" runs it without the unit's
sandbox, systemd.service(5), "Command lines"), and the sandboxed daemon only finds the images
(one `docker image inspect` per image). A daemon started without that step (a terminal, the
tests) builds them itself, as before.

Either way the service manager's start timeout is pushed ahead while a first build runs
(EXTEND_TIMEOUT_USEC, sd_notify(3)); the unit's `NotifyAccess=exec` is what lets the
ExecStartPre process say so.
"""

from __future__ import annotations

import logging
import os
import sys

import trio

from .config import ApplianceConfig
from .notify import Notifier

log = logging.getLogger("applianced.images")

# While the images are built at start (minutes, the first time), the service manager's start
# timeout is pushed this far ahead, again every third of it (EXTEND_TIMEOUT_USEC).
IMAGE_BUILD_EXTEND = 60.0
# The files of an image are readable by its users whatever umask the unit gives applianced
# (UMask=0077): debootstrap and the setup scripts create files with the process's umask.
IMAGE_BUILD_UMASK = 0o022


def resolve_images(config: ApplianceConfig) -> tuple[str, str]:
    """(agent, infra) image tags: configured, or built/found by images.build for Docker."""
    agent, infra = config.images.agent, config.images.infra
    if agent and infra:
        return agent, infra
    if config.daemon.provider != "docker":
        return agent or "none", infra or "none"
    from images.build import ensure_images

    # Built once per recipe and cached (images/); a no-op when the tagged images exist.
    tags = ensure_images()
    return agent or tags.agent, infra or tags.infra


async def resolve_images_notifying(config: ApplianceConfig, notifier: Notifier) -> tuple[str, str]:
    """resolve_images in a thread, the service manager's start timeout pushed ahead meanwhile."""
    notifier.status("starting: the agent and infra images (a first start builds them)")
    async with trio.open_nursery() as nursery:

        async def extend() -> None:
            while True:
                notifier.extend_timeout(IMAGE_BUILD_EXTEND)
                await trio.sleep(IMAGE_BUILD_EXTEND / 3)

        if notifier.enabled:
            nursery.start_soon(extend)
        # A build failure is raised after the nursery, as itself: raised inside it, it would
        # come out wrapped in an ExceptionGroup whose message names no step.
        failure: Exception | None = None
        try:
            images = await trio.to_thread.run_sync(resolve_images, config)
        except Exception as exc:
            failure = exc
        nursery.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return images


def build_images_step(config: ApplianceConfig) -> int:
    """`applianced --build-images`: find or build the images, then exit (0, or 1 and why)."""
    old = os.umask(IMAGE_BUILD_UMASK)
    notifier = Notifier()
    try:
        agent, infra = trio.run(resolve_images_notifying, config, notifier)
    except Exception as exc:  # images.build's errors name the step and the log file
        print(f"applianced: images: {exc}", file=sys.stderr, flush=True)
        notifier.status(f"failed: images: {exc}")
        return 1
    finally:
        notifier.close()
        os.umask(old)
    print(f"applianced: images ready: agent {agent}, infra {infra}", flush=True)
    return 0
