"""systemd's notify protocol (``Type=notify``): readiness, watchdog pings, stopping.

The protocol is one datagram per message to the unix socket named by ``$NOTIFY_SOCKET``
(sd_notify(3)); a name starting with ``@`` is in the abstract namespace. Outside systemd the
variable is unset and every call is a no-op, so the daemon runs the same under a terminal.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping

log = logging.getLogger(__name__)


class Notifier:
    """Sends sd_notify messages; ``environ`` is injectable for tests."""

    def __init__(self, environ: Mapping[str, str] | None = None) -> None:
        env = os.environ if environ is None else environ
        address = env.get("NOTIFY_SOCKET") or None
        if address and address.startswith("@"):
            address = "\0" + address[1:]
        self._address = address
        self._warned = False
        usec = env.get("WATCHDOG_USEC", "")
        pid = env.get("WATCHDOG_PID", "")
        mine = not pid or pid == str(os.getpid())
        #: seconds between watchdog pings systemd expects (half its timeout), or None
        self.watchdog_interval_s: float | None = (
            int(usec) / 2e6 if usec.isdigit() and int(usec) > 0 and mine else None
        )

    @property
    def enabled(self) -> bool:
        return self._address is not None

    def send(self, message: str) -> bool:
        """Send one message (e.g. ``READY=1``); False when not under systemd or it failed."""
        if self._address is None:
            return False
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
                sock.sendto(message.encode(), self._address)
            return True
        except OSError as err:
            if not self._warned:  # once: a lost watchdog ping will show in systemd's own log
                log.warning("sd_notify to %r failed: %s", self._address, err)
                self._warned = True
            return False

    def ready(self, status: str = "") -> bool:
        return self.send("READY=1" + (f"\nSTATUS={status}" if status else ""))

    def watchdog(self) -> bool:
        return self.send("WATCHDOG=1")

    def status(self, text: str) -> bool:
        return self.send(f"STATUS={text}")

    def reloading(self) -> bool:
        return self.send("RELOADING=1")

    def stopping(self) -> bool:
        return self.send("STOPPING=1")
