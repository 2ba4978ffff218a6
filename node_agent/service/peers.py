"""Who is on the other end of a connection to the daemon: the uid, never the address.

A local user has all of 127/8 (and every address of the host) to connect from, so a cap per
source address caps nothing; a cap per uid does. :func:`unix_peer` reads ``SO_PEERCRED`` of a
Unix socket (the kernel's word, as the peer connected); :func:`tcp_peer_uid` asks the kernel's
socket diagnostics (``NETLINK_SOCK_DIAG``, the interface ``ss -e`` reads) for the owner of the
*other* end of a TCP connection, which exists only when that end is on this host.
"""

from __future__ import annotations

import ipaddress
import socket
import struct
from dataclasses import dataclass

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
_NLMSGHDR = struct.Struct("=IHHII")
#: inet_diag_msg: family, state, timer, retrans; sockid (48 bytes); expires, rqueue, wqueue,
#: uid, inode (linux/inet_diag.h)
_DIAG_MSG = struct.Struct("=BBBB48sIIIII")


@dataclass(frozen=True)
class UnixPeer:
    pid: int
    uid: int
    gid: int


def unix_peer(sock: socket.socket) -> UnixPeer:
    """The credentials of a Unix socket's peer as it connected (``SO_PEERCRED``)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", raw)
    return UnixPeer(pid, uid, gid)


def tcp_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of the accepted TCP connection ``sock`` when that end is
    on this host, else None (a remote peer, or the kernel would not say)."""
    try:
        local, peer = sock.getsockname(), sock.getpeername()
    except OSError:
        return None
    peer_ip = ipaddress.ip_address(peer[0])
    local_ip = ipaddress.ip_address(local[0])
    if isinstance(peer_ip, ipaddress.IPv6Address) and peer_ip.ipv4_mapped is not None:
        peer_ip = peer_ip.ipv4_mapped
        mapped = local_ip.ipv4_mapped if isinstance(local_ip, ipaddress.IPv6Address) else None
        local_ip = mapped or local_ip
    family = socket.AF_INET if peer_ip.version == 4 else socket.AF_INET6
    # the peer's own socket: its source is the peer's address, its destination ours
    sockid = (
        struct.pack(">HH", peer[1], local[1])
        + peer_ip.packed.ljust(16, b"\0")
        + local_ip.packed.ljust(16, b"\0")
        + struct.pack("=III", 0, INET_DIAG_NOCOOKIE, INET_DIAG_NOCOOKIE)
    )
    body = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    header = _NLMSGHDR.pack(_NLMSGHDR.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, 1, 0)
    try:
        with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG) as nl:
            nl.settimeout(0.5)
            nl.send(header + body)
            reply = nl.recv(8192)
    except OSError:
        return None
    if len(reply) < _NLMSGHDR.size + _DIAG_MSG.size:
        return None
    _length, kind, _flags, _seq, _pid = _NLMSGHDR.unpack_from(reply)
    if kind == NLMSG_ERROR:
        return None
    return int(_DIAG_MSG.unpack_from(reply, _NLMSGHDR.size)[8])
