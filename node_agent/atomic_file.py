"""How the agent creates its own files and directories: atomically, privately, never through a
path another user controls (DESIGN.md, "Trust boundary"; docs/security.md); and how it reads a
file someone else supplied.

- :func:`write_text`, :func:`write_json`: temp file in the same directory (``mkstemp``: ``O_EXCL``, mode 0600), fsync,
  ``os.replace``: the file is the old one or the new one, never half of one, and a symlink
  planted at the final name is replaced, not followed.
- :func:`private_dir`: the state directory and its subdirectories are 0700 and the agent's own;
  a directory someone else owns, or whose parent anyone may rename entries in, is refused.
- :func:`create_private`: a new file with ``O_CREAT|O_EXCL|O_NOFOLLOW``, mode 0600.
- :func:`ensure_spool_dirs`: the spools training jobs write to, one sticky directory per kind,
  whatever the agent's umask; :func:`spool_unreachable` names a directory on the way that
  keeps training users out.
- :func:`ensure_user_spool`: a uid's own heartbeat directory, made by root for that uid, or
  taken back from whoever squatted its name.
- :func:`read_foreign`: a file someone else supplied (a readings directory, an ``nvidia-smi``
  dump): a regular file with one link, opened without following a link or blocking, size-capped.
- :func:`remove_tree`: remove a tree another user made, through directory fds, never following
  a link or leaving the file system, without recursion, holding at most a few dozen fds.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import secrets
import stat
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

#: the spool kinds: what node_agent.heartbeat and node_agent.sdc write
SPOOL_KINDS = ("heartbeat", "sdc")


class UnsafeDirectory(OSError):
    """A directory the agent will not keep its state in (owner, mode or parent are wrong)."""


def write_text(path: Path, text: str, *, sync_dir: bool = False) -> None:
    """Replace ``path`` with ``text``: a new temp file beside it (``mkstemp``: ``O_EXCL``, mode
    0600, an unguessable name), fsync, ``os.replace``. Another user's symlink at the final name
    is replaced, never written through. A lone surrogate (text a user wrote can carry one
    into a report) is written as its escape, ``\\ud800``, never a failed write.

    ``sync_dir``: fsync the directory too, so the rename itself survives a crash (where the
    file system allows it)."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="backslashreplace") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if sync_dir:
        with contextlib.suppress(OSError):  # not every file system lets a directory be synced
            dfd = os.open(path.parent, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)


def write_json(path: Path, data: Any) -> None:
    """Replace ``path`` with ``data`` as indented, key-sorted JSON (``str`` for other types);
    creates the parent directory (0700)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    write_text(path, json.dumps(data, sort_keys=True, indent=1, default=str))


def create_private(path: Path, append: bool = False) -> int:
    """Open ``path`` for writing, mode 0600, never through a symlink; a new file unless
    ``append`` (then an existing regular file is appended to). Returns the fd."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
    flags |= os.O_APPEND if append else os.O_EXCL
    fd = os.open(path, flags, 0o600)
    if append:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            os.close(fd)
            raise UnsafeDirectory(
                f"{path} is not a regular file of uid {os.geteuid()}; not written (remove it)"
            )
    return fd


def _check_parent(path: Path) -> None:
    parent = path.parent
    st = os.stat(parent)
    if st.st_uid not in (0, os.geteuid()):
        raise UnsafeDirectory(
            f"{parent} (the parent of {path}) is owned by uid {st.st_uid}, "
            "who could replace the directory: choose a state_dir under a "
            "directory root owns (the default is /var/lib/node-agent)"
        )
    if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirectory(
            f"{parent} (the parent of {path}) is writable by everyone without "
            "the sticky bit, so anyone could replace the directory: choose a "
            "state_dir under a directory root owns"
        )


def make_dirs(path: Path, mode: int) -> None:
    """Make ``path`` (``mode``) and its missing parents (0755), whatever the umask: under the
    systemd unit's and the CLI's 077, ``mkdir -p`` makes every parent 0700, and a parent the
    state dir (0700) shares with the spool then keeps every training user out of the spool.
    Modes are set with ``chmod`` after ``mkdir``; an existing directory is left as it is."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    for made in reversed(missing):
        with contextlib.suppress(OSError):  # made by someone else meanwhile: theirs to set
            os.chmod(made, mode if made == path else 0o755)


def spool_unreachable(root: Path | str) -> list[str]:
    """A note for each directory on the way to the spool ``root`` that other users may not
    pass (neither ``o+x`` nor ``g+x``), naming it and the fix; [] when training users can
    reach the spool. A directory traversable by its group only is taken as the operator's
    choice (training users in that group)."""
    notes = []
    real = Path(os.path.realpath(root))
    for d in reversed(real.parents):
        try:
            mode = os.stat(d).st_mode
        except OSError as err:
            notes.append(f"cannot read {d} on the way to the spool: {err.strerror or err}")
            break
        if not mode & (stat.S_IXOTH | stat.S_IXGRP):
            notes.append(
                f"training users cannot reach the spool {root}: {d} is mode "
                f"{stat.S_IMODE(mode):04o}, so no user can write heartbeats or SDC verdicts "
                f"and hang detection sees no job's own report; fix: chmod o+x {d} (or set "
                "spool_dir outside it; the state dir itself stays 0700)"
            )
    return notes


def _refuse_foreign_links(path: Path) -> None:
    """UnsafeDirectory when ``path`` or a directory above it is a symbolic link another user
    made: in a sticky /tmp-like directory a user can plant ``state_dir``'s name as a link to a
    root directory, which root would then chmod 0700 and write its state into."""
    owners = (0, os.geteuid())
    for p in (path, *path.parents):
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            continue
        if stat.S_ISLNK(st.st_mode) and st.st_uid not in owners:
            raise UnsafeDirectory(
                f"{p} (on the way to {path}) is a symbolic link made by uid {st.st_uid}: "
                "another user chose where it leads; remove it, or choose a state_dir under a "
                "directory root owns (the default is /var/lib/node-agent)"
            )


def private_dir(path: Path | str) -> Path:
    """``path`` as a directory only this user may enter (0700), made with missing parents
    (0755: a parent it shares with the spool must let training users through).

    An existing directory of ours with group/other permissions is tightened to 0700 (an older
    agent made it 0755). Raises :class:`UnsafeDirectory` when it belongs to another user or
    sits in a directory others may rename entries in, or when another user's symbolic link
    leads to it; OSError when it cannot be made."""
    path = Path(path)
    _refuse_foreign_links(path)
    make_dirs(path, 0o700)
    real = path.resolve()
    _check_parent(real)
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeDirectory(
            f"{path} is owned by uid {st.st_uid}, not by the agent (uid "
            f"{os.geteuid()}): the agent keeps its state only in a directory "
            "of its own; chown it or choose another state_dir"
        )
    if stat.S_IMODE(st.st_mode) != 0o700:
        os.chmod(real, 0o700)
    return path


def ensure_spool_dirs(root: Path | str, kinds: Iterable[str] = SPOOL_KINDS) -> list[str]:
    """Make the spool ``root`` (0755, the agent's) and one directory per kind in it that
    training users can write to but not delete each other's files in (1777: sticky, like
    /tmp). Modes are set with ``chmod`` after ``mkdir``, so the agent's umask (077 under the
    systemd unit and the CLI) cannot leave a spool nobody else may enter. An existing root
    the agent made 0700 is opened to 0755. An existing kind directory keeps its mode (an
    operator may restrict it to a group, 1770) except that the sticky bit is added when others
    may write to it. Returns notes of what was changed or is wrong (a symlink, another owner,
    a directory on the way others may not pass: :func:`spool_unreachable`), for the log;
    never raises."""
    root, notes = Path(root), []
    try:
        make_dirs(root, 0o755)
        st = os.lstat(root)
        if stat.S_ISLNK(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            notes.append(
                f"spool {root} is a symlink, owned by uid {st.st_uid} or writable by "
                "others: anyone who may write to it can swap its kind directories; "
                f"make it a directory of uid {os.geteuid()}, mode 0755"
            )
        elif stat.S_IMODE(st.st_mode) & 0o055 != 0o055:
            os.chmod(root, stat.S_IMODE(st.st_mode) | 0o755)
            notes.append(
                f"spool {root} was mode {stat.S_IMODE(st.st_mode):04o}, so training "
                "users could not reach their spools: made it 0755"
            )
    except OSError as err:
        return [f"cannot make the spool {root}: {err.strerror or err}"]
    notes += spool_unreachable(root)
    for kind in kinds:
        d = root / kind
        try:
            if not d.exists():
                d.mkdir(mode=0o700)
                os.chmod(d, 0o1777)  # mkdir's mode passes through the umask
                notes.append(f"made spool {d} (mode 1777)")
                continue
            st = os.lstat(d)
            if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
                notes.append(
                    f"spool {d} is a symlink or not a directory: it is not read; "
                    "make it a directory (mode 1777)"
                )
            elif st.st_uid != os.geteuid():
                notes.append(
                    f"spool {d} is owned by uid {st.st_uid}, who may remove what "
                    f"others write in it: make it uid {os.geteuid()}'s, mode 1777"
                )
            elif st.st_mode & (stat.S_IWOTH | stat.S_IWGRP) and not st.st_mode & stat.S_ISVTX:
                os.chmod(d, stat.S_IMODE(st.st_mode) | stat.S_ISVTX)
                notes.append(
                    f"spool {d} had no sticky bit (any writer could delete another's "
                    "files): added it"
                )
        except OSError as err:
            notes.append(f"cannot make spool {d}: {err.strerror or err}")
    return notes


#: :func:`read_foreign`'s default cap: more than any tool output the agent converts (a
#: kernel log of a long boot is a few MiB, ``nvidia-smi -q -x`` of 8 GPUs about 300 KiB)
FOREIGN_MAX_BYTES = 32 << 20


class ForeignFileRefused(OSError):
    """A file someone else supplied that the agent will not read; the message names it, says
    what it is, and what to do."""


def read_foreign(
    path: Path | str, *, dir_fd: int | None = None, max_bytes: int = FOREIGN_MAX_BYTES
) -> bytes:
    """The bytes of ``path`` (relative to ``dir_fd`` when given), a file someone else may have
    made: ``O_NOFOLLOW`` (a symlink, say to /etc/shadow, is refused, never read),
    ``O_NONBLOCK`` (a FIFO cannot stall the reader), then ``fstat``: a regular file with one
    link (a hard link to a file its maker could not read is refused too) of at most
    ``max_bytes``. Raises :class:`ForeignFileRefused` naming the file and why, or OSError when
    it cannot be opened (missing, no permission)."""
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise ForeignFileRefused(
                f"{path} is a symbolic link: a supplied file is never followed; copy the "
                "file itself there"
            ) from None
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            kind = {
                stat.S_IFIFO: "a FIFO",
                stat.S_IFCHR: "a character device",
                stat.S_IFBLK: "a block device",
                stat.S_IFDIR: "a directory",
                stat.S_IFSOCK: "a socket",
            }.get(stat.S_IFMT(st.st_mode), "not a regular file")
            raise ForeignFileRefused(f"{path} is {kind}, not a regular file: not read")
        if st.st_nlink != 1:
            raise ForeignFileRefused(
                f"{path} has {st.st_nlink} hard links: not read (it may be another "
                "user's file linked in); copy the file itself there"
            )
        if st.st_size > max_bytes:
            raise ForeignFileRefused(
                f"{path} is {st.st_size} bytes, more than the {max_bytes} read: not read"
            )
        chunks, total = [], 0
        while total <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > max_bytes:
            raise ForeignFileRefused(f"{path} grew past {max_bytes} bytes while read: not read")
        return b"".join(chunks)
    finally:
        os.close(fd)


#: :func:`remove_tree`'s caps: directory fds held at once (deeper directories are moved up to
#: the tree's top and removed from there), and entries removed in one call (each costs a few
#: microseconds; a user can make as many as its inode quota allows)
REMOVE_MAX_DEPTH = 32
REMOVE_MAX_ENTRIES = 200_000

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def remove_tree(
    parent_fd: int,
    name: str,
    *,
    where: Path | str | None = None,
    max_depth: int = REMOVE_MAX_DEPTH,
    max_entries: int = REMOVE_MAX_ENTRIES,
) -> str | None:
    """Remove the entry ``name`` of the directory open as ``parent_fd``, and everything in it
    when it is a directory, as ``rm -rf --one-file-system`` would; returns None when it is
    gone, else a sentence saying what is left and how to remove it. Never raises.

    Made for trees another user made: every directory is opened through its parent's fd with
    ``O_NOFOLLOW`` (a link is unlinked, never followed); a directory on another file system is
    left alone; nothing recurses, and at most ``max_depth`` directory fds are held: a directory
    found deeper is renamed to the top of the tree under a new name and removed from there, so
    a tree nested thousands deep is removed whole (``shutil.rmtree`` recurses once per level
    and raises RecursionError near 1,000). At most ``max_entries`` entries are removed in one
    call. ``where``: the directory ``parent_fd`` is, for the sentence."""
    path = Path(where or f"/proc/self/fd/{parent_fd}") / name
    try:
        st = os.stat(name, dir_fd=parent_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=parent_fd)
            return None
        top = os.open(name, _DIR_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        return f"cannot remove {path}: {err.strerror or err}; remove it by hand"
    try:
        left = _empty_tree(top, os.fstat(top).st_dev, max_depth, max_entries)
        if left is None:
            os.rmdir(name, dir_fd=parent_fd)
    except OSError as err:
        left = f"{err.strerror or err}"
    finally:
        os.close(top)
    if left is None:
        return None
    return (
        f"could not remove all of {path} ({left}); remove it by hand: "
        f"rm -rf --one-file-system {path}"
    )


def _empty_tree(top: int, dev: int, max_depth: int, max_entries: int) -> str | None:
    """Remove everything in the directory open as ``top`` (see :func:`remove_tree`); None when
    it is empty, else why not. Raises OSError."""
    stack: list[tuple[int, str]] = [(top, "")]  # (fd, its name in the directory below it)
    budget = max_entries
    try:
        while stack:
            fd = stack[-1][0]
            subdir = None
            with os.scandir(fd) as entries:
                for entry in entries:
                    budget -= 1
                    if budget < 0:
                        return f"more than {max_entries} entries"
                    if entry.is_dir(follow_symlinks=False):
                        subdir = entry.name
                        break
                    os.unlink(entry.name, dir_fd=fd)
            if subdir is None:  # empty now: remove it from the directory it is in
                if len(stack) == 1:
                    return None
                _, done = stack.pop()
                os.close(fd)
                os.rmdir(done, dir_fd=stack[-1][0])
            elif len(stack) >= max_depth:  # too deep to hold: move it up to the top
                os.rename(subdir, f".deep-{secrets.token_hex(8)}", src_dir_fd=fd, dst_dir_fd=top)
            else:
                child = os.open(subdir, _DIR_FLAGS, dir_fd=fd)
                if os.fstat(child).st_dev != dev:
                    os.close(child)
                    return f"{subdir} is on another file system (a mount point)"
                stack.append((child, subdir))
        return None
    finally:
        for fd, _ in stack[1:]:
            os.close(fd)


def ensure_user_spool(spool_dir: Path | str, uid: int) -> str | None:
    """Make ``<spool_dir>/<uid>`` uid's own heartbeat directory (mode 0700, owner ``uid``), as
    root; returns a note when something was wrong, else None. Never raises.

    Only in a shared, sticky spool owned by the agent (the heartbeat spool: 1777). Anything
    else under that name (another user's directory, a link, a file: a squat that would keep
    uid's writer out) is renamed aside and removed, and the note names its owner; uid's own
    directory that others may write to is made 0700. Everything is done through directory fds
    opened without following links, so the entry cannot be swapped for a link meanwhile."""
    d = Path(spool_dir)
    name = str(int(uid))
    try:
        top = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        return f"cannot open the heartbeat spool {d}: {err.strerror or err}"
    try:
        st = os.fstat(top)
        if st.st_uid != os.geteuid() or not st.st_mode & stat.S_ISVTX:
            return None  # not the agent's shared spool: nothing to make for others here
        note = None
        try:
            have = os.stat(name, dir_fd=top, follow_symlinks=False)
        except FileNotFoundError:
            have = None
        if have is not None and stat.S_ISDIR(have.st_mode) and have.st_uid == uid:
            if not have.st_mode & 0o022:
                return None
            fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
            try:
                os.fchmod(fd, 0o700)
            finally:
                os.close(fd)
            return (
                f"heartbeat directory {d / name} of uid {uid} could be written by others "
                f"(mode {stat.S_IMODE(have.st_mode):04o}): made it 0700"
            )
        if have is not None:
            aside = f".squatted-{name}-{secrets.token_hex(6)}"
            os.rename(name, aside, src_dir_fd=top, dst_dir_fd=top)
            moved = os.stat(aside, dir_fd=top, follow_symlinks=False)  # what was really moved
            left = remove_tree(top, aside, where=d)
            what = "a directory" if stat.S_ISDIR(moved.st_mode) else "not a directory"
            note = (
                f"heartbeat directory name {d / name} was taken by uid {have.st_uid} "
                f"({what}), keeping uid {uid}'s heartbeats out: "
                + ("removed it" if left is None else f"moved it aside, but {left}")
                + f" and made uid {uid}'s own"
            )
        os.mkdir(name, 0o700, dir_fd=top)
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
        try:
            os.fchown(fd, uid, -1)
            os.fchmod(fd, 0o700)
        finally:
            os.close(fd)
        return note
    except OSError as err:
        return f"cannot make heartbeat directory {d / name} for uid {uid}: {err.strerror or err}"
    finally:
        os.close(top)
