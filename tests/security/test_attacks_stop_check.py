"""A local user takes stop-check's rendezvous port before rank 0 (issue 34, the critical one).

Root's ranks of ``node-agent stop-check`` meet through a TCP store on a fixed port. The attacker,
a real ``useradd`` user, runs its own torch ``TCPStore`` on that port first and plays rank 0 as
well as it can: the store's keys listed (torch has ``Store.list_keys``), a forged "joined"
record carrying every rank's nonce, and the old protocol's pickle, whose ``__reduce__`` would
create a marker file as whoever unpickles it, with forged results naming a healthy node. All of
it in a private network namespace (``unshare -n``), so nothing else on the host shares the port.

Root's three ranks must stop: no marker file (no code of the user's ran as root), no
``stop-check.json``, no report naming anyone, nothing drained (the ``log`` adapter's
``actions.log`` stays absent), and every rank exits 2 with one short line on stderr.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytest.importorskip("torch", reason="stop-check and the attacker's store need torch")

AGENT = str(Path(sys.executable).with_name("node-agent"))
WORLD = 3
PORT = 29533  # the port of the shipped Slurm and Kubernetes examples

ATTACKER = r"""
import json, os, sys, time
from datetime import timedelta
import torch.distributed as dist

port, world, marker = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
store = dist.TCPStore("127.0.0.1", port, None, True, timedelta(seconds=60),
                      wait_for_workers=False)
print("listening", flush=True)


class Payload:  # unpickled by a rank, this runs as that rank's user
    def __reduce__(self):
        return (os.system, (f"touch {marker}",))


# the new protocol as a stranger sees it: list the keys, read the join records (their nonces
# are in clear), answer with a "joined" record carrying every nonce, under a key of its own
forged_key = os.urandom(32)
from node_agent.stopcheck import signed

# the old protocol: a joined record for rank 0's pickle and forged results in the gathers below
old = dist.PrefixStore("node-agent/stop-check", store)
old.set("joined", json.dumps({"nodes": {str(r): f"node{r}" for r in range(world)},
                              "missing": []}))
answered = False
end = time.monotonic() + 240
while not answered and time.monotonic() < end:
    time.sleep(0.2)
    for key in store.list_keys():
        prefix, _, rest = key.rpartition("/join/")
        names = [f"{prefix}/join/{r}" for r in range(1, world)]
        if not prefix or not store.check(names):
            continue  # wait for every rank but rank 0 (which cannot have the port)
        members = []
        for r in range(1, world):
            body = json.loads(store.get(f"{prefix}/join/{r}")[32:])
            members.append({"rank": r, "node": body["data"]["node"],
                            "nonce": body["data"]["nonce"]})
        record = {"members": members, "missing": [0], "refused": []}
        store.set(f"{prefix}/joined", signed.seal(forged_key, "join", "joined", 0, 0, record))
        answered = True
        break
try:
    dist.init_process_group("gloo", store=dist.PrefixStore("pg", old), rank=0,
                            world_size=world, timeout=timedelta(seconds=120))
    out = [None] * world
    dist.all_gather_object(out, ("node1", Payload()))
    dist.all_gather_object(out, {"node": "node1", "level": "FAULT", "reasons": ["forged"]})
except Exception as err:
    print(f"attacker: {type(err).__name__}", file=sys.stderr)
time.sleep(60)
"""


@pytest.fixture
def netns():
    """A private network namespace with its loopback up; argv prefix that enters it."""
    if os.geteuid() != 0:
        pytest.skip("a private network namespace needs root")
    for tool in ("unshare", "nsenter", "ip"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} is not installed (util-linux, iproute2)")
    holder = subprocess.Popen(["unshare", "-n", "sleep", "600"], stderr=subprocess.PIPE)
    try:
        ns = f"/proc/{holder.pid}/ns/net"
        for _ in range(100):  # until unshare has made the namespace (not ours any more)
            if holder.poll() is not None or os.readlink(ns) != os.readlink("/proc/self/ns/net"):
                break
            time.sleep(0.05)
        if holder.poll() is not None:
            pytest.skip(f"unshare -n failed here: {holder.stderr.read().decode()[:200]}")
        enter = ["nsenter", f"--net={ns}", "--"]
        up = subprocess.run([*enter, "ip", "link", "set", "lo", "up"], capture_output=True)
        assert up.returncode == 0, up.stderr
        yield enter
    finally:
        holder.kill()
        holder.wait()


def test_a_user_on_the_rendezvous_port_runs_no_code_and_names_no_node(user, shared_dir, netns):
    work = shared_dir / "job"
    work.mkdir(mode=0o700)
    marker = shared_dir / "marker"  # the user may create files here only by running as root
    shared_dir.chmod(0o755)
    key = work / "job.key"
    key.write_text(secrets.token_hex(32) + "\n")
    key.chmod(0o600)
    scen = work / "scenarios"
    scen.mkdir()
    for r in range(WORLD):
        (scen / f"n{r}.yaml").write_text(
            yaml.safe_dump({"sku": "h100-sxm5-80gb", "gpus": 2, "hostname": f"node{r}"})
        )
    state, out = work / "state", work / "out"
    (work / "config.yaml").write_text(yaml.safe_dump({"state_dir": str(state)}))

    squatter = subprocess.Popen(
        [*netns, *user.drop, user.python, "-c", ATTACKER, str(PORT), str(WORLD), str(marker)],
        env=user.env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
    )
    user.children.append(squatter)
    assert squatter.stdout.readline().strip() == "listening", squatter.stderr.read()[-2000:]

    ranks = {
        r: subprocess.Popen(
            [
                *netns,
                AGENT,
                "stop-check",
                "--config",
                str(work / "config.yaml"),
                "--key-file",
                str(key),
                "--simulate",
                str(scen / "n{rank}.yaml"),
                "--out",
                str(out),
                "--act",
                "--adapter",
                "log",
                "--join-timeout-s",
                "15",
            ],
            env={
                **os.environ,
                "RANK": str(r),
                "WORLD_SIZE": str(WORLD),
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(PORT),
            },
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=work,
        )
        for r in range(WORLD)
    }
    done = {r: p.communicate(timeout=240) for r, p in ranks.items()}

    assert not marker.exists(), "the user's pickle ran as root"
    assert not (out / "stop-check.json").exists(), (done, (out / "stop-check.json").read_text())
    assert not list(out.glob("report-*.json")) if out.exists() else True
    assert not (state / "actions.log").exists(), "a node was drained on a stranger's word"
    for r, p in ranks.items():
        lines = [line for line in done[r][1].splitlines() if line.strip()]
        assert p.returncode == 2, (r, done[r][1][-2000:])
        assert len(lines) == 1 and len(lines[0]) < 400 and "nothing" in lines[0], (r, lines)
    assert "cannot listen on 127.0.0.1:29533" in done[0][1]
    for r in range(1, WORLD):
        assert "does not carry the job key's signature" in done[r][1], done[r][1]
