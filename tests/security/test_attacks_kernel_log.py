"""Issue 29's critical attack: fake Xids through the kernel's own messages.

When a program faults, the kernel logs ``comm[pid]: segfault at ... in <name of the mapped
file>[...]`` (arch/x86/mm/fault.c, ``show_signal_msg`` and ``print_vma_addr``). A user names a
file after a driver line (``Xid (PCI:0000:18:00): 79, GPU has fallen off the bus``), maps it
executable and jumps into it: about fifteen lines of standard-library Python, no privilege. The
agent used to find ``Xid (`` anywhere in a line, graded the node FAULT, drained it and asked for
a replacement.

Here the attack is done for real by a ``useradd`` user (``conftest.py``): its program really
segfaults in a file so named, and the test reads back the exact ``/dev/kmsg`` record the kernel
wrote (facility 0: the kernel's own). Where this kernel does not log user segfaults
(``debug.exception-trace`` is 0), or /dev/kmsg cannot be read, the record is built exactly as
the kernel writes it and the test says so in its output (``recorded_by``). The record goes into
the kernel log the agent reads (a file the test owns, ``kernel_log.path``: no test reads the
host's log, tests/conftest.py); ``node-agent check --act`` and the daemon then read it through
the same kmsg record parser they use on ``/dev/kmsg``. Both must stay HEALTHY and take no action;
a genuine driver record in the same file is graded (the control), so the log was read.

A user's write to ``/dev/kmsg`` is the second way in: the device is root's (0644), and where
something may write it, the kernel gives the record facility 1 (``devkmsg_write``); such a
record is never believed.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
import yaml
from waiting import wait_for  # tests/waiting.py

REPO = Path(__file__).resolve().parents[2]
GPU_LESS = "0000:18:00"  # the bus the fake lines name: no NVIDIA device needs to be there

#: the line forms of the attack, each the name of the file the user's program faults in
ATTACK_NAMES = {
    "xid79": f"Xid (PCI:{GPU_LESS}): 79, GPU has fallen off the bus",
    "xid48": f"Xid (PCI:{GPU_LESS}): 48, pid=1, An uncorrectable double bit error (DBE) has been "
    "detected on GPU in the framebuffer at partition 6, subpartition 0.",
    "nvrm_fallen": f"NVRM: GPU {GPU_LESS}.0: GPU has fallen off the bus.",
    "sxid": "nvidia-nvswitch0: SXid (PCI:0000:06:00.0): 20034, Fatal, Link 48 LTSSM Fault Up",
}

#: the user's program: name a file after a driver line, map it executable, jump into it (the
#: zero bytes are "add [rax], al", a write through a null pointer). argv: directory, file
#: name, the process name to take (prctl PR_SET_NAME; "" keeps "python3").
SEGFAULT_IN_NAMED_FILE = r"""
import ctypes, mmap, os, sys
directory, name, comm = sys.argv[1], sys.argv[2], sys.argv[3]
libc = ctypes.CDLL(None, use_errno=True)
if comm:
    libc.prctl(15, comm.encode()[:15], 0, 0, 0)
path = os.path.join(directory, name)
with open(path, "wb") as f:
    f.write(b"\0" * 4096)
fd = os.open(path, os.O_RDONLY)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
address = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_EXEC, mmap.MAP_PRIVATE, fd, 0)
print(os.getpid(), address, flush=True)
ctypes.CFUNCTYPE(None)(address)()
"""

#: a genuine driver record (the kernel's facility, the driver's prefix): the control
GENUINE_XID13 = (
    "4,{seq},{usec},-;NVRM: Xid (PCI:0000:3b:00): 13, pid=7, name=python3, Graphics "
    "SM Warp Exception on (GPC 0, TPC 1, SM 0): Out Of Range Address"
)


def _kmsg_records() -> list[str]:
    """Every record in the ring buffer, raw (``prio,seq,usec,flags;message``). The test reads
    it only to copy the attack's own record; the agent never reads the host's log here."""
    fd = os.open("/dev/kmsg", os.O_RDONLY | os.O_NONBLOCK)
    records = []
    try:
        while True:
            try:
                chunk = os.read(fd, 8192)
            except BlockingIOError:
                break
            except BrokenPipeError:  # overwritten while reading
                continue
            if not chunk:
                break
            records.append(chunk.decode("utf-8", "replace").split("\n", 1)[0])
    finally:
        os.close(fd)
    return records


def _exception_trace_on() -> bool:
    try:
        return Path("/proc/sys/debug/exception-trace").read_text().strip() != "0"
    except OSError:
        return False


def _sequence(record: str) -> int:
    """A kmsg record's sequence number (``prio,seq,usec,flags;``), -1 for none."""
    fields = record.split(";", 1)[0].split(",")
    return int(fields[1]) if len(fields) > 1 and fields[1].isdigit() else -1


def segfault_record(user, directory: Path, name: str, comm: str = "") -> tuple[str, str]:
    """(the kmsg record of the user's segfault in a file called ``name``, how it was had).

    Its record is the one after the crash with its pid: the ring buffer keeps earlier runs'
    crashes, and a pid is reused."""
    readable = _exception_trace_on() and os.access("/dev/kmsg", os.R_OK)
    before = max((_sequence(r) for r in _kmsg_records()), default=-1) if readable else -1
    done = user.py(SEGFAULT_IN_NAMED_FILE, str(directory), name, comm, check=False)
    assert done.returncode in (-11, 139), f"the user's program did not segfault: {done}"
    pid = int(done.stdout.split()[0])
    if readable:
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            mine = [
                r
                for r in _kmsg_records()
                if f"[{pid}]: segfault at " in r and _sequence(r) > before
            ]
            if mine:
                assert name in mine[0], f"the kernel's record does not name the file: {mine[0]}"
                return mine[0], "the kernel (read back from /dev/kmsg)"
            time.sleep(0.1)
    # emulated exactly as arch/x86/mm/fault.c prints it, prio 6 = facility 0 (kernel), level 6
    shown = (comm or "python3")[:15]
    return (
        f"6,90001,404608925,-;{shown}[{pid}]: segfault at 0 ip 00007f294070e000 sp "
        f"00007ffc0d02cd28 error 6 in {name}[0,7f294070e000+1000] likely on CPU 0 "
        "(core 0, socket 0)",
        "emulated: this kernel logs no user segfaults here",
    )


def run_agent(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "node_agent.commands.main", *args],
        capture_output=True,
        text=True,
        timeout=240,
        cwd="/",
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


def check_act(config: Path) -> tuple[int, dict]:
    done = run_agent("check", "--act", "--json", "--config", str(config))
    assert done.returncode in (0, 3, 4), done.stderr[-3000:]
    return done.returncode, json.loads(done.stdout)


@pytest.mark.parametrize("form", sorted(ATTACK_NAMES))
@pytest.mark.parametrize("comm", ["", "NVRM: Xid (PCI:"], ids=["python3", "named-like-NVRM"])
def test_segfault_in_a_file_named_like_a_driver_line_leaves_check_act_healthy(
    user, attack_dir, node, form, comm
):
    config, kernel_log = node
    record, recorded_by = segfault_record(user, attack_dir, ATTACK_NAMES[form], comm)
    print(f"record ({recorded_by}): {record}")
    kernel_log.write_text(record + "\n")
    code, report = check_act(config)
    assert (code, report["grade"]["level"]) == (0, "HEALTHY"), report["grade"]
    assert report["actions"] == []
    assert not [r for r in report["results"] if r["check"] == "xid" and r["status"] == "fail"]
    # the control: a genuine driver record in the same log is read and graded
    kernel_log.write_text(record + "\n" + GENUINE_XID13.format(seq=90002, usec=404608999) + "\n")
    done = run_agent("check", "--json", "--config", str(config))
    graded = json.loads(done.stdout)
    assert [
        (r["target"], r["value"])
        for r in graded["results"]
        if r["check"] == "xid" and r["status"] == "fail"
    ] == [("pci:0000:3b:00", 13)]


def test_a_users_write_to_dev_kmsg_is_refused_or_not_believed(user, node):
    """The user cannot open /dev/kmsg for writing (root's, 0644). Where something can (root
    here, as a root container or a misconfigured mode could), the kernel stamps the record
    facility 1, user: read back from /dev/kmsg, or built exactly so where it cannot be read."""
    config, kernel_log = node
    tried = user.py(
        "import os\ntry:\n    os.open('/dev/kmsg', os.O_WRONLY)\n    print('opened')\n"
        "except OSError as e:\n    print(type(e).__name__)\n",
        check=False,
    )
    assert tried.stdout.strip() in ("PermissionError", "FileNotFoundError"), tried
    marker = uuid.uuid4().hex[:8]
    line = (
        f"NVRM: Xid (PCI:{GPU_LESS}): 79, pid='<unknown>', name=<unknown>, GPU has fallen off "
        f"the bus. {marker}"
    )
    record = None
    try:
        fd = os.open("/dev/kmsg", os.O_WRONLY)
        try:
            os.write(fd, f"<4>{line}\n".encode())  # level 4, no facility: the kernel picks it
        finally:
            os.close(fd)
        record = next((r for r in _kmsg_records() if marker in r), None)
    except OSError:
        pass
    if record is None:  # not writable or not readable here: the record devkmsg_write makes
        record = f"12,90003,404609000,-;{line}"
    assert int(record.split(",", 1)[0]) >> 3 == 1, f"not the user facility: {record}"
    kernel_log.write_text(record + "\n")
    code, report = check_act(config)
    assert (code, report["grade"]["level"], report["actions"]) == (0, "HEALTHY", [])


def daemon_on(node, shared_dir, monkeypatch):
    """Root's daemon in real mode, acting (``daemon.act``), following ``node``'s kernel log with
    a periodic ``xid`` check every second; yields (daemon, the actions it recorded)."""
    from node_agent.service.daemon import Daemon

    config, _ = node
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = yaml.safe_load(config.read_text())
    data["daemon"] = {"listen": f"127.0.0.1:{port}", "xid_poll_s": 0.2, "act": True}
    config.write_text(yaml.safe_dump(data))
    suite = shared_dir / "periodic.yaml"
    suite.write_text(
        yaml.safe_dump(
            {
                "name": "attack-periodic",
                "mode": "service",
                "checks": [
                    {"check": "xid", "timeout_s": 20, "every_s": 1, "params": {"since": "boot"}}
                ],
            }
        )
    )
    acted: list[object] = []
    original = Daemon.record_action

    def recording(self, action, outcome):
        acted.append((action, outcome))
        original(self, action, outcome)

    monkeypatch.setattr(Daemon, "record_action", recording)
    daemon = Daemon(str(config), None, suite=str(suite))
    thread = threading.Thread(target=lambda: daemon.run(install_signals=False), daemon=True)
    thread.start()
    assert wait_for(lambda: daemon.listen_address, 15), "daemon did not start"
    return daemon, thread, acted


def assert_daemon_healthy_then_reads_a_genuine_line(daemon, kernel_log, acted):
    """The daemon's grade stays HEALTHY with no action after several watch polls and periodic
    checks; a genuine driver line appended then is graded within seconds (it was reading)."""
    time.sleep(3)
    assert daemon.grade.level.name == "HEALTHY", daemon.grade
    assert not [
        r for r in daemon.current_results() if r.check == "xid" and r.status.value == "fail"
    ]
    assert acted == []
    with kernel_log.open("a") as log:
        log.write(GENUINE_XID13.format(seq=90010, usec=404609999) + "\n")
    assert wait_for(lambda: daemon.grade.level.name == "WARN", 10), daemon.grade
    assert [(r.target, r.level.name) for r in daemon.grade.reasons if r.rule == "xid"] == [
        ("pci:0000:3b:00", "WARN")
    ]


def test_daemon_watching_the_log_takes_no_action_on_the_injected_lines(
    user, attack_dir, node, shared_dir, monkeypatch
):
    """The daemon follows its kernel log while the user segfaults in each named file."""
    _, kernel_log = node
    daemon, thread, acted = daemon_on(node, shared_dir, monkeypatch)
    try:
        for name in ATTACK_NAMES.values():
            record, _ = segfault_record(user, attack_dir, name)
            with kernel_log.open("a") as log:
                log.write(record + "\n")
        assert_daemon_healthy_then_reads_a_genuine_line(daemon, kernel_log, acted)
    finally:
        daemon.stop()
        thread.join(5)


def test_the_attack_record_would_have_been_a_fault_for_a_reader_that_searched_the_line():
    """What the attack relied on, kept as a check on the fixture: the record holds a complete
    driver line in its middle (a reader searching for ``Xid (`` anywhere found Xid 79)."""
    name = ATTACK_NAMES["xid79"]
    record = f"6,1,1,-;python3[1]: segfault at 0 ip 0 sp 0 error 6 in {name}[7f294070e000+1000]"
    assert re.search(r"Xid \(PCI:0000:18:00\): 79", record)
    from node_agent.kernel_log import parse_line

    assert parse_line(record) is None
