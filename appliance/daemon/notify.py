"""sd_notify(3): applianced tells its service manager how it is doing.

Theory of operation
-------------------
Under a unit with `Type=notify`, systemd passes the address of a datagram socket in
`$NOTIFY_SOCKET` (a file system path, or "@name" for the abstract namespace) and, with
`WatchdogSec=`, the interval in `$WATCHDOG_USEC` (and the pid it is meant for in
`$WATCHDOG_PID`). A message is one datagram of newline-separated `KEY=VALUE` assignments:

    STATUS=...              a line `systemctl status` shows (each start-up step; a degradation)
    EXTEND_TIMEOUT_USEC=N   the start-up takes longer than TimeoutStartSec (the first image build)
    READY=1                 serving: admin socket up, proxy workers up, reconcile done
    WATCHDOG=1              alive; sent every WATCHDOG_USEC / 2 by a task of the trio loop, so
                            it stops when the loop stops running (systemd then kills and
                            restarts applianced as the unit says)
    STOPPING=1              shutting down

Without `$NOTIFY_SOCKET` (a terminal, the tests, `up --detach`) every call does nothing. The
variables are removed from the environment once read, as sd_notify(3)'s `unset_environment`
does, so the proxy workers and anything else applianced starts do not inherit them.

Why no library: the protocol is the few lines below (sd_notify(3), "NOTES"). python-systemd
needs libsystemd's headers to build; `sdnotify` (PyPI) is unmaintained since 2017 and swallows
every error; neither adds anything these lines do not do.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import MutableMapping

import trio

log = logging.getLogger("applianced.notify")


class Notifier:
    def __init__(self, environ: MutableMapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.pop("NOTIFY_SOCKET", "")
        usec = env.pop("WATCHDOG_USEC", "")
        watchdog_pid = env.pop("WATCHDOG_PID", "")
        self._address: str | bytes | None = None
        if address.startswith("@"):
            self._address = b"\0" + address[1:].encode()  # the abstract namespace
        elif address.startswith("/"):
            self._address = address
        elif address:
            log.warning("NOTIFY_SOCKET=%r is neither a path nor @name: not notifying", address)
        self._socket: socket.socket | None = None
        self._warned = False
        # sd_watchdog_enabled(3): the interval is for us only if WATCHDOG_PID is unset or ours.
        self.watchdog_interval: float | None = None
        if usec.isdigit() and int(usec) > 0 and watchdog_pid in ("", str(os.getpid())):
            self.watchdog_interval = int(usec) / 1e6 / 2
        self._last_status: str | None = None
        self._stopping = False

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, *assignments: str) -> None:
        """One datagram; never raises (a service manager that went away is not our failure)."""
        if self._address is None:
            return
        try:
            if self._socket is None:
                self._socket = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC
                )
                self._socket.setblocking(False)
            self._socket.sendto("\n".join(assignments).encode(), self._address)
        except OSError as exc:
            if not self._warned:
                log.warning("cannot notify the service manager at %r: %s", self._address, exc)
                self._warned = True

    def status(self, text: str) -> None:
        """A STATUS= line, sent only when it changed; none after STOPPING (the workers' exits
        on the way out are not a degradation)."""
        text = " ".join(text.split())  # one line
        if text != self._last_status and not self._stopping:
            self._last_status = text
            self.send(f"STATUS={text}")

    def ready(self, text: str) -> None:
        self._last_status = " ".join(text.split())
        self.send("READY=1", f"STATUS={self._last_status}")

    def stopping(self, text: str = "stopping") -> None:
        self._stopping = True
        self._last_status = text
        self.send("STOPPING=1", f"STATUS={text}")

    def extend_timeout(self, seconds: float) -> None:
        self.send(f"EXTEND_TIMEOUT_USEC={int(seconds * 1e6)}")

    async def keep_watchdog(
        self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> None:
        """WATCHDOG=1 every half interval, for as long as the trio loop runs this task."""
        task_status.started()
        if self.watchdog_interval is None or self._address is None:
            return
        while True:
            self.send("WATCHDOG=1")
            await trio.sleep(self.watchdog_interval)

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close()
            self._socket = None
