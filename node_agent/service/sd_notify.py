"""systemd's notify protocol (``Type=notify``): readiness, watchdog pings, stopping; and the
sockets systemd holds for the daemon (socket activation).

The protocol is one datagram per message to the unix socket named by ``$NOTIFY_SOCKET``
(sd_notify(3)); a name starting with ``@`` is in the abstract namespace. Outside systemd the
variable is unset and every call is a no-op, so the daemon runs the same under a terminal.

Socket activation (sd_listen_fds(3)): a ``.socket`` unit's listening sockets are passed as file
descriptors 3, 4, ... with ``$LISTEN_FDS`` their count and ``$LISTEN_PID`` the process they are
for. systemd keeps them open across restarts of the service, so a client that connects while
the daemon restarts waits in the backlog instead of finding no socket.
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


#: the first file descriptor systemd passes (SD_LISTEN_FDS_START)
LISTEN_FDS_START = 3


def inherited_unix_listener(
    path: str, environ: dict[str, str] | None = None
) -> socket.socket | None:
    """The listening Unix stream socket systemd passed this process bound to ``path``, or None
    (not socket-activated, or no passed socket is that one)."""
    env = os.environ if environ is None else environ
    count, pid = env.get("LISTEN_FDS", ""), env.get("LISTEN_PID", "")
    if not count.isdigit() or int(count) == 0 or pid != str(os.getpid()):
        return None
    for fd in range(LISTEN_FDS_START, LISTEN_FDS_START + int(count)):
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        if sock.family == socket.AF_UNIX and sock.type == socket.SOCK_STREAM:
            try:
                bound = sock.getsockname()
                listening = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
            except OSError:
                bound, listening = None, 0
            if listening and isinstance(bound, str) and _same_file(bound, path):
                return sock
        sock.detach()  # not ours to close
    log.warning(
        "systemd passed %s socket(s), none of them bound to %s: check the socket unit's "
        "ListenStream= against daemon.nvhcd.socket; serving a socket of the daemon's own",
        count,
        path,
    )
    return None


def _same_file(a: str, b: str) -> bool:
    """The same path, or two paths to one file (``/var/run`` is ``/run``)."""
    if a == b:
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)
