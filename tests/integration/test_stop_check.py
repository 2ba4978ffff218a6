"""``node-agent stop-check`` over six simulated nodes (four in the Slurm step): a real process
per node, one rank each, joined by real torch.distributed (gloo) on loopback, started by
torchrun, by a real Slurm step (srun on the test cluster's slurmd) or as a launcher would set
RANK/WORLD_SIZE.

Each node is a scenario (``--simulate DIR/n{rank}.yaml``): its GPUs are simulated, and its
faults act at the compute boundary (``sdc``) and the transport boundary (``slow_link``); the
phases, the localisation, the grading and the remediation are the real code. No GPU is needed.

Slow on purpose: a six-rank test starts six agents that each run the quick suite before the
phases, CPU-bound work that the CI machine's cores share. Each such test is the only one of its
launcher (torchrun, a launcher's RANK and WORLD_SIZE, a Slurm step) or of its fault (a phase
naming its node, the replay), so none can share another's run; the tests of a refusal (a key, a
rank, a scenario) start one to three ranks. Where the launcher is not what a test is about, its
ranks are forks of one interpreter that imported torch once (:func:`run_ranks`), not six
interpreters importing it each; the torchrun and Slurm tests, and those that read what a rank
prints before it sets torch's log level, start the real ``node-agent``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from preloaded_agent import Invocation, Zygote

from node_agent.peers import free_loopback_port

pytest.importorskip("torch", reason="stop-check computes with torch: make deps-test")

AGENT = str(Path(sys.executable).with_name("node-agent"))
NODES = 6
RUN_TIMEOUT_S = 300


def make_key(path: Path, mode: int = 0o600) -> Path:
    """A job key as the launchers make it: 32 random bytes as hex, private to its owner."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")
    path.chmod(mode)
    return path


@pytest.fixture
def job(tmp_path):
    """Scenarios for six nodes (``node0``..``node5``, healthy unless given faults) and a config."""
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state")}))

    def make(faults: dict[int, list[dict]] | None = None, nodes: int = NODES) -> Path:
        scen = tmp_path / "scenarios"
        scen.mkdir(exist_ok=True)
        for rank in range(nodes):
            (scen / f"n{rank}.yaml").write_text(
                yaml.safe_dump(
                    {
                        "sku": "h100-sxm5-80gb",
                        "gpus": 8,
                        "hostname": f"node{rank}",
                        "faults": (faults or {}).get(rank, []),
                    }
                )
            )
        return scen

    make.config = config  # type: ignore[attr-defined]
    make.key = make_key(tmp_path / "job.key")  # type: ignore[attr-defined]

    def args(scen: Path, out: bool = True) -> list[str]:
        """The options every rank takes: the config, the job's key, its scenario, --out."""
        common = ["--config", str(config), "--key-file", str(make.key)]  # type: ignore[attr-defined]
        common += ["--simulate", str(scen / "n{rank}.yaml")]
        return common + (["--out", str(tmp_path / "out")] if out else [])

    make.args = args  # type: ignore[attr-defined]
    make.out = tmp_path / "out"  # type: ignore[attr-defined]
    return make


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """A rank's environment as a launcher sets it (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)."""
    return {
        **os.environ,
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def spawn(ranks, world: int, args: list[str], port: int, cwd: Path) -> dict[int, subprocess.Popen]:
    """Start the given ranks as a launcher would, each ``node-agent`` its own interpreter."""
    procs = {}
    for rank in ranks:
        env = rank_env(rank, world, port)
        procs[rank] = subprocess.Popen(
            [AGENT, "stop-check", *args],
            env=env,
            cwd=cwd,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
    return procs


def finish(procs: dict[int, subprocess.Popen]) -> dict[int, tuple[int, str]]:
    out = {}
    for rank, proc in procs.items():
        try:
            _, err = proc.communicate(timeout=RUN_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            raise
        out[rank] = (proc.returncode, err)
    return out


def run_ranks(
    zygote: Zygote, ranks, world: int, args: list[str], port: int, cwd: Path
) -> dict[int, tuple[int, str]]:
    """The given ranks run to their end, as :func:`spawn` and :func:`finish` run them, but each
    a fork of this worker's zygote, which imported torch once (``agent_zygote``,
    tests/preloaded_agent.py): every rank is still a process of its own joined by real gloo;
    only the imports are shared."""
    ranks = list(ranks)
    invocations = [Invocation(["stop-check", *args], rank_env(r, world, port), cwd) for r in ranks]
    done = zygote.run(invocations, RUN_TIMEOUT_S)
    return {r: (code, err) for r, (code, _, err) in zip(ranks, done, strict=True)}


def summary(out: Path) -> dict:
    return json.loads((out / "stop-check.json").read_text())


def suspects_or_nothing(out: Path) -> object:
    """What a failed run's summary names, for the assertion's message (it may not exist)."""
    try:
        return summary(out)["suspects"]
    except (OSError, ValueError, KeyError) as err:
        return f"no summary: {err}"


def named(data: dict, phase: str | None = None) -> set[tuple[str, int | None]]:
    return {
        (s["node"], s.get("gpu")) for s in data["suspects"] if phase is None or s["phase"] == phase
    }


def node_report(out: Path, node: str) -> dict:
    [path] = out.glob(f"report-{node}-stop-check-*.json")
    return json.loads(path.read_text())


def test_a_healthy_six_node_job_under_torchrun_names_no_suspect(job, tmp_path):
    scen = job()
    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent))
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python (it ships with torch)")
    proc = subprocess.run(
        [
            torchrun,
            "--nnodes",
            "1",
            "--nproc-per-node",
            str(NODES),
            "--master-port",
            str(free_loopback_port()),
            "--no-python",
            AGENT,
            "stop-check",
            *job.args(scen),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, (suspects_or_nothing(job.out), proc.stderr[-3000:])
    data = summary(job.out)
    assert data["schema"] == "node-agent.stop-check/1"
    assert data["suspects"] == [] and data["evict"] == []
    assert set(data["nodes"].values()) == {f"node{r}" for r in range(NODES)}
    for phase in ("self", "intra_node", "neighbours", "alignment"):
        assert "error" not in data["phases"][phase] and "skipped" not in data["phases"][phase]
    assert data["phases"]["replay"]["skipped"] == "not asked (--replay)"
    for r in range(NODES):
        assert node_report(job.out, f"node{r}")["grade"]["level"] == "HEALTHY"


def test_each_phase_names_exactly_its_bad_node_and_act_drains_them(job, tmp_path, agent_zygote):
    """node1 fails its quick suite (Xid 64), node3's link is slow, node4's GPU 1 corrupts every
    product: each phase names exactly its node, and --act drains each through the remediation."""
    scen = job(
        {
            1: [{"kind": "xid", "gpu": 5, "code": 64}],
            3: [{"kind": "slow_link", "factor": 0.2}],
            4: [{"kind": "sdc", "gpu": 1}],
        }
    )
    args = [
        *job.args(scen),
        "--act",
        "--adapter",
        "log",
    ]
    codes = run_ranks(agent_zygote(), range(NODES), NODES, args, free_loopback_port(), tmp_path)
    data = summary(job.out)
    assert named(data, "self") == {("node1", None)}
    assert named(data, "neighbours") == {("node3", None)}
    assert named(data, "alignment") == {("node4", 1)}
    assert named(data) == {("node1", None), ("node3", None), ("node4", 1)}
    assert data["phases"]["alignment"]["suspects"][0]["evidence"]["repeated"] is True
    assert {r: c for r, (c, _) in codes.items()} == {0: 0, 1: 4, 2: 0, 3: 3, 4: 3, 5: 0}
    for node, level in (("node1", "FAULT"), ("node3", "ERROR"), ("node4", "ERROR")):
        report = node_report(job.out, node)
        assert report["grade"]["level"] == level
        assert [a["action"] for a in report["actions"]][:1] == ["drain"], report["actions"]
    for node in ("node0", "node2", "node5"):
        report = node_report(job.out, node)
        assert report["grade"]["level"] == "HEALTHY" and report["actions"] == []


def test_a_node_that_cannot_compute_is_warn_and_the_others_say_the_phases_were_skipped(
    job, tmp_path, agent_zygote
):
    """node2's GPUs cannot compute (its scenario names an SM its GPU does not have, as a node
    whose torch cannot use its GPUs would say): the compute phases are skipped on every node,
    each report saying why, and node2 is WARN, never HEALTHY on phases it did not run."""
    scen = job({2: [{"kind": "sdc", "gpu": 1, "sm": 100000}]}, nodes=3)
    run_ranks(agent_zygote(), range(3), 3, job.args(scen), free_loopback_port(), tmp_path)
    assert summary(job.out)["suspects"] == []
    for node in ("node0", "node1", "node2"):
        results = {r["metric"]: r for r in node_report(job.out, node)["results"]}
        skipped = results["stop_check_alignment"]
        assert skipped["status"] == "skip" and "no compute on node2" in skipped["detail"]
    mine = node_report(job.out, "node2")
    assert mine["grade"]["level"] == "WARN"
    (warn,) = [r for r in mine["results"] if r["metric"] == "stop_check_compute"]
    assert warn["status"] == "warn" and "names sm 100000" in warn["detail"]
    for node in ("node0", "node1"):
        assert node_report(job.out, node)["grade"]["level"] == "HEALTHY"


def test_replay_names_the_node_whose_sm_corrupts_now_and_then(job, tmp_path, agent_zygote):
    scen = job({2: [{"kind": "sdc", "gpu": 6, "sm": 17, "rate": 0.3}]})
    args = [
        *job.args(scen),
        "--replay",
        "--rounds",
        "4",
    ]
    run_ranks(agent_zygote(), range(NODES), NODES, args, free_loopback_port(), tmp_path)
    data = summary(job.out)
    assert named(data, "replay") == {("node2", None)}
    assert named(data) <= {("node2", None), ("node2", 6)}
    assert data["phases"]["replay"]["figures"] == {"rounds": 4, "rows": 2, "columns": 3}


@pytest.mark.xdist_group("slurm")
def test_a_slurm_step_names_the_bad_node_and_evicts_its_parallel_group(job, slurm, tmp_path):
    """The same stop-check as one step of the real test cluster: srun starts one task per
    simulated node (SLURM_PROCID, SLURM_NTASKS) on the loopback slurmd. Four nodes in two
    parallel groups: the launcher and the widening to a group are what is new here (the phases
    have six nodes in the tests above), and four name one node and keep the other group."""
    nodes = 4
    scen = job({3: [{"kind": "sdc", "gpu": 1}]}, nodes=nodes)
    topology = tmp_path / "topology.yaml"
    topology.write_text(yaml.safe_dump({"pp0": ["node0", "node1"], "pp1": ["node2", "node3"]}))
    srun = shutil.which("srun")
    if srun is None:
        pytest.skip("srun is not installed (Debian package slurm-client)")
    env = {**slurm.env(), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_loopback_port())}
    for key in ("RANK", "WORLD_SIZE"):
        env.pop(key, None)
    proc = subprocess.run(
        [
            srun,
            "--overcommit",
            "-N1",
            f"-n{nodes}",
            "--kill-on-bad-exit=0",
            AGENT,
            "stop-check",
            *job.args(scen),
            "--topology",
            str(topology),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        env=env,
        cwd=tmp_path,
    )
    assert (job.out / "stop-check.json").exists(), (proc.returncode, proc.stderr[-3000:])
    data = summary(job.out)
    assert named(data) == {("node3", 1)}
    assert data["evict"] == ["node2", "node3"]


def test_a_rank_that_never_joins_is_named_by_rank_0_and_the_others_exit_2(
    job, tmp_path, agent_zygote
):
    scen = job(nodes=3)
    args = [
        *job.args(scen),
        "--join-timeout-s",
        "5",
    ]
    codes = run_ranks(agent_zygote(), range(2), 3, args, free_loopback_port(), tmp_path)
    assert {r: c for r, (c, _) in codes.items()} == {0: 2, 1: 2}
    assert "rank 2 did not join" in codes[0][1]
    assert "rank 2 did not join; rank 0 names them" in codes[1][1]  # told before rank 0 went
    data = summary(job.out)
    assert [(s["node"], s["phase"]) for s in data["suspects"]] == [("node2", "join")]
    assert data["suspects"][0]["evidence"]["did_not_join"] is True


def test_a_rank_without_its_scenario_exits_2_with_one_line(job, tmp_path):
    scen = job(nodes=2)
    (scen / "n1.yaml").unlink()
    args = job.args(scen, out=False)
    codes = finish(spawn([1], 2, args, free_loopback_port(), tmp_path))
    code, err = codes[1]
    assert code == 2
    assert err.strip().splitlines() == [
        f"node-agent: error: --simulate {scen}/n{{rank}}.yaml: no scenario for rank 1 "
        f"({scen}/n1.yaml does not exist)"
    ]


def test_a_one_node_job_is_a_usage_error(job, tmp_path):
    codes = finish(
        spawn(
            [0],
            1,
            ["--config", str(job.config), "--key-file", str(job.key)],
            free_loopback_port(),
            tmp_path,
        )
    )
    code, err = codes[0]
    assert code == 2 and "WORLD_SIZE=1" in err and len(err.strip().splitlines()) == 1


def test_a_rank_with_the_wrong_key_stops_every_rank_with_exit_2_and_names_nobody(job, tmp_path):
    scen = job(nodes=3)
    wrong = make_key(tmp_path / "other.key")
    common = [*job.args(scen), "--act", "--adapter", "log", "--join-timeout-s", "60"]
    port = free_loopback_port()
    procs = spawn([0, 1], 3, common, port, tmp_path)
    procs.update(spawn([2], 3, [*common, "--key-file", str(wrong)], port, tmp_path))
    codes = finish(procs)
    for rank, (code, err) in codes.items():
        lines = [line for line in err.splitlines() if line.strip()]
        assert code == 2, (rank, err[-2000:])
        assert len(lines) == 1 and "nothing named" in lines[0], (rank, lines)
    assert "could not verify the join record of rank 2" in codes[0][1]
    assert "rank 0 stopped the run" in codes[2][1]  # told at once, not after the deadline
    assert not (job.out / "stop-check.json").exists()
    assert not list(job.out.glob("report-*.json")) if job.out.exists() else True
    assert not (tmp_path / "state" / "actions.log").exists()


@pytest.mark.parametrize("problem", ["missing", "mode 0644", "symlink"])
def test_a_missing_or_loose_key_file_is_exit_2_naming_it_with_nothing_run(job, tmp_path, problem):
    scen = job(nodes=2)
    args = [a for a in job.args(scen) if a not in ("--key-file", str(job.key))]
    if problem == "mode 0644":
        job.key.chmod(0o644)
        args += ["--key-file", str(job.key)]
    elif problem == "symlink":
        link = tmp_path / "link.key"
        link.symlink_to(job.key)
        args += ["--key-file", str(link)]
    code, err = finish(spawn([1], 2, args, free_loopback_port(), tmp_path))[1]
    assert code == 2
    [line] = err.strip().splitlines()
    assert {
        "missing": "needs --key-file",
        "mode 0644": f"{job.key} has mode 0644",
        "symlink": "link.key is a symbolic link",
    }[problem] in line
    assert not job.out.exists()


@pytest.mark.xdist_group("slurm")
@pytest.mark.parametrize("how", ["sourced", "run"])
def test_the_slurm_step_script_makes_the_key_and_leaves_the_callers_shell_alone(
    slurm, tmp_path, how
):
    """packaging/slurm/stop-check-step.sh inside a real batch job whose own script has no
    ``set -u``: it makes the key, sbcasts it, passes --key-file (the one-node job then stops at
    WORLD_SIZE=1, exit 2, after the key was accepted), removes the node's copy, and the caller's
    options, PATH and unset variables are as they were."""
    script = Path(__file__).resolve().parents[2] / "packaging" / "slurm" / "stop-check-step.sh"
    call = f". {script}" if how == "sourced" else f"{script}"
    batch = tmp_path / "job.sh"
    batch.write_text(
        "#!/bin/bash\n"
        'before="$- $PATH"\n'
        f"export STOP_CHECK_OUT={tmp_path}/out NODE_AGENT_PATH={Path(AGENT).parent}\n"
        f"{call}\n"
        'echo "rc=$?"\n'
        'echo "same=$([ "$before" = "$- $PATH" ] && echo yes || echo no)"\n'
        'echo "unset=${NEVER_SET_ANYWHERE}end"\n'
        'echo "left=$(ls /tmp/node-agent-stop-check-"$SLURM_JOB_ID"-*.key 2>/dev/null | wc -l)"\n'
    )
    done = subprocess.run(
        [
            "sbatch",
            "--wait",
            "-o",
            str(tmp_path / "out.txt"),
            "-e",
            str(tmp_path / "err.txt"),
            str(batch),
        ],
        env={**slurm.env(), "PYTHONPATH": os.environ.get("PYTHONPATH", "")},
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        cwd=tmp_path,
    )
    out = (tmp_path / "out.txt").read_text()
    err = (tmp_path / "err.txt").read_text()
    assert done.returncode == 0, (done.stderr, out, err)
    assert "WORLD_SIZE=1" in err, err  # checked after the key file: it was accepted
    assert out.splitlines()[-4:] == ["rc=2", "same=yes", "unset=end", "left=0"], (out, err)


EXCHANGE_RANK = r"""
import sys
from datetime import timedelta
import torch.distributed as dist
from node_agent.stopcheck.signed import Exchange, PeerUnverified

rank, port, strict = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "strict"
store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
ex = Exchange(bytes(32), "s" * 32, rank, 2)
print(ex.gather("one", {"x": rank}))
try:
    ex.gather("two", {"x": rank}, {"x": str} if strict else None)
except PeerUnverified as err:
    print(f"stopped: {err}")
"""


def test_a_rank_that_cannot_verify_a_message_stops_the_others_too(tmp_path):
    """Two real gloo ranks: the first exchange verifies on both; in the second only rank 1
    refuses what it got (it expects another type), and rank 0, which verified everything,
    stops as well instead of going on alone."""
    port = free_loopback_port()
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", EXCHANGE_RANK, str(r), str(port), "strict" if r else "lax"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        for r in (0, 1)
    ]
    outs = [p.communicate(timeout=RUN_TIMEOUT_S)[0].splitlines() for p in procs]
    assert [o[0] for o in outs] == ["[{'x': 0}, {'x': 1}]"] * 2, outs
    assert outs[0][1] == "stopped: another rank could not verify a two message", outs
    assert outs[1][1].startswith("stopped: rank 0's two message does not fit its schema"), outs
