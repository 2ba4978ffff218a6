"""Who is on the other end of a local socket: the uid, never the address.

A local user has all of 127/8 (and every address of the host) to connect from, so a cap per
source address caps nothing; a cap per uid does. :func:`unix_peer` reads ``SO_PEERCRED`` of a
Unix socket (the kernel's word, as the peer connected); :func:`tcp_peer_uid` asks the kernel's
socket diagnostics (``NETLINK_SOCK_DIAG``, the interface ``ss -e`` reads) for the owner of the
*other* end of a TCP connection, which exists only when that end is on this host.

The other way round, before the agent believes what a local service answers
(:func:`why_not_trusted`): any user may listen on a free port above 1023, and where the service
the agent asks is not running (DCGM's ``nv-hostengine`` on 5555), the first user to bind its
port answers in its name, and what it says becomes evidence (a health watch's failure is a
FAULT). So a service on this host is asked only when every socket listening on its port belongs
to root or to an account the operator named (the service's own, such as ``nvidia-dcgm``), read
from the kernel's socket tables (``/proc/net/tcp`` and ``tcp6``, the ``uid`` of each LISTEN
socket, in the network namespace the agent connects in). A service on another host is the
operator's to secure and is not judged here.
"""

from __future__ import annotations

import ipaddress
import pwd
import secrets
import socket
import stat
import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import psutil

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
INET_DIAG_NOCOOKIE = 0xFFFFFFFF
#: the kernel's TCP socket tables, and the state a listening socket has in them
NET = Path("/proc/net")
TABLES = ("tcp", "tcp6")
LISTEN = "0A"
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


def listener_uids(port: int, net: Path = NET) -> set[int]:
    """The uids of the sockets listening on TCP ``port``, on any address; OSError when neither
    table can be read."""
    uids: set[int] = set()
    read = 0
    for table in TABLES:
        try:
            lines = (net / table).read_text().splitlines()[1:]
        except FileNotFoundError:
            continue  # no IPv6 on this kernel
        read += 1
        for line in lines:
            fields = line.split()
            if len(fields) < 8 or fields[3] != LISTEN:
                continue
            try:
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    uids.add(int(fields[7]))
            except (IndexError, ValueError):
                continue
    if not read:
        raise OSError(f"neither {net}/tcp nor {net}/tcp6 can be read")
    return uids


def split_host_port(address: str, default_port: int) -> tuple[str, int]:
    """``host``, ``host:port``, ``[v6]:port`` or a bare IPv6 address -> (host, port)."""
    if address.startswith("["):
        host, _, rest = address[1:].partition("]")
        return host, int(rest[1:]) if rest.startswith(":") and rest[1:].isdigit() else default_port
    host, sep, port = address.rpartition(":")
    if sep and host.count(":") == 0 and port.isdigit():
        return host, int(port)
    return address, default_port


def on_this_host(host: str) -> bool:
    """``host`` resolves to a loopback address or to one of this host's own."""
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return False
    own = {
        ipaddress.ip_address(a.address.split("%")[0])
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        if ip.is_loopback or ip.is_unspecified or ip in own:
            return True
    return False


def trusted_uids(accounts: Iterable[str]) -> set[int]:
    """Root's uid and those of ``accounts`` that exist on this host."""
    uids = {0}
    for name in accounts:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            continue
    return uids


def why_not_trusted(
    address: str, default_port: int, accounts: Sequence[str], net: Path = NET
) -> str | None:
    """Why the service at ``address`` may not be asked, or None when it may: it is on another
    host, or every socket listening on its port is root's or one of ``accounts``'."""
    host, port = split_host_port(address, default_port)
    if not on_this_host(host):
        return None
    try:
        uids = listener_uids(port, net)
    except OSError as err:
        return f"who listens on port {port} of this host cannot be read ({err})"
    if not uids:
        return f"nothing listens on port {port} of this host"
    return _strangers(port, uids, accounts)


def held_by_another(port: int, accounts: Sequence[str] = (), net: Path = NET) -> str | None:
    """Why the agent's own programs may not meet on ``port`` of this host (None: no one but
    root or ``accounts`` listens there): another user's program would answer one of them."""
    try:
        uids = listener_uids(port, net)
    except OSError as err:
        return f"who listens on port {port} of this host cannot be read ({err})"
    return _strangers(port, uids, accounts)


#: the lowest port free_loopback_port draws from; below the kernel's ephemeral range
PORTS_FROM = 10000


def free_loopback_port(ports_range: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")) -> int:
    """A TCP port on 127.0.0.1 free at the moment of asking, drawn at random below the
    kernel's ephemeral range: no other user can know it in advance (unlike a fixed one), and
    no outgoing connection is given it meanwhile (a port the kernel picked from that range can
    be, before the program it is for listens on it)."""
    try:
        ephemeral = int(ports_range.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768
    for _ in range(64):
        port = PORTS_FROM + secrets.randbelow(max(1, ephemeral - PORTS_FROM))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        picked: int = sock.getsockname()[1]
        return picked


def _strangers(port: int, uids: set[int], accounts: Sequence[str]) -> str | None:
    strangers = sorted(uids - trusted_uids(accounts))
    if not strangers:
        return None
    names = ", ".join(f"uid {uid} ({_name(uid)})" for uid in strangers)
    return (
        f"port {port} of this host is held by {names}, not by root or "
        f"{', '.join(accounts) or 'an account named in the config'}: another user's program "
        "may be answering there"
    )


def why_socket_not_trusted(path: Path, accounts: Sequence[str]) -> str | None:
    """Why the Unix socket at ``path`` may not be asked (None: it may): it must be a socket,
    and root's or one of ``accounts``'."""
    try:
        st = path.lstat()
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err})"
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket"
    if st.st_uid not in trusted_uids(accounts):
        return (
            f"{path} belongs to uid {st.st_uid} ({_name(st.st_uid)}), not to root or "
            f"{', '.join(accounts) or 'an account named in the config'}"
        )
    return None


def _name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return "no such user"
