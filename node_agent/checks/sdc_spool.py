"""Check ``sdc_spool``: SDC verdicts that training jobs wrote to the spool, taken as *reports*.

Training jobs run ``node_agent.sdc.SdcProbe``, which writes every non-pass verdict atomically to
the spool, ``<spool_dir>/sdc/`` (config ``spool_dir``, default ``/var/spool/node-agent``; see
``docs/sdc.md``). Any training user can write there, so a verdict is what one user *says*
(DESIGN.md, "Trust boundary"; docs/security.md). This check reads the files it has not read
before, safely (``sdc.read_verdicts``: no link followed, nothing that blocks, size and depth
capped), learns each file's owner from ``fstat``, and:

- ``confirmed`` by a uid that runs a compute process on the GPU the verdict names (NVML's
  process list, each pid's uid from ``/proc``): a **report** (``sdc_reported`` warn) that makes
  the agent run *its own* ``sdc`` probe on that GPU, in a child process (the periodic suite's
  ``sdc`` params, ``confirm_repeats`` rounds, the GPU and the node of this run). Only the
  agent's own confirmation grades FAULT (``sdc_confirmed`` fail, ``source: agent probe``); a
  clean probe leaves a WARN naming the reporter; a probe that could not run (no time left, too
  little free GPU memory, no compute) keeps the report pending, retried after
  ``confirm_retry_s``;
- ``confirmed`` by anyone else: ``sdc_report_unverified`` warn naming the writer's uid, never
  an action;
- ``transient`` -> ``sdc_transient`` warn; ``error`` -> ``sdc_probe_error`` warn (a job's probe
  could not run: its report, not the agent's error); both name the writer's uid;
- a ``.json`` file that is not a valid verdict (a link, a FIFO, too big, a bad field) ->
  ``sdc_spool_unreadable`` warn, once.

What was read is recorded in a cursor file, ``<state_dir>/sdc/spool-cursor.json`` (under an
``flock`` in the private state directory, so the daemon and a Slurm health check never ingest
the same file twice), so each verdict file is graded once. The one exception is deliberate: an
SDC the *agent's own probe* confirmed stays standing — every later run reports it again as a
FAULT — until the GPU it names is replaced (its UUID changes) or an operator runs
``node-agent set-healthy`` (:func:`clear_standing`), because a GPU that computed wrong does not
heal and a later "HEALTHY" must not hand it back to training. Deleting spool files changes
nothing: they are reports, and the standing fault is the agent's own finding.

The cursor forgets a file once it is gone from the spool, so it stays as small as the spool
(which holds only non-pass verdicts by default). Files are left in place as evidence.

GPU mapping: a verdict carrying ``evidence['gpu_uuid']`` maps to the inventory GPU with that
UUID; otherwise ``cuda:N`` maps to ``gpu:N``, and the detail says that this is the job's CUDA
index (under ``CUDA_VISIBLE_DEVICES`` it may not be the node's index).

Params: ``spool_dir`` (default ``<config spool_dir>/sdc``), ``confirm`` (default true: false
leaves every report a WARN and never probes), ``confirm_repeats`` (3), ``confirm_timeout_s``
(300; always within this check's own ``timeout_s``), ``confirm_retry_s`` (600, the periodic
``sdc`` cadence).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from node_agent import proc
from node_agent.atomic_file import write_json
from node_agent.checking import child
from node_agent.checking.behaviour import ServiceBehaviour
from node_agent.checking.context import CheckContext
from node_agent.checking.params import Reader
from node_agent.checking.sdc_metrics import SdcVerdicts
from node_agent.gpu.base import GpuError
from node_agent.model import Result, Status, utc_iso

if TYPE_CHECKING:
    from node_agent.sdc.spool import SpooledVerdict

#: in the daemon: a confirmed or cleared report counts in node_agent_sdc_probes_total, with the
#: sdc check's own verdicts (checking/sdc_metrics.py)
SERVICE = ServiceBehaviour(metrics=SdcVerdicts)
CURSOR_SCHEMA = "node-agent.sdc-spool-cursor/1"
DEFAULT_CONFIRM_REPEATS = 3
DEFAULT_CONFIRM_TIMEOUT_S = 300.0
DEFAULT_CONFIRM_RETRY_S = 600.0  # the periodic suite's sdc cadence: no more probing than that
#: a child probe needs this much of the check's time to be worth starting: torch's import,
#: CUDA start-up and one round of the periodic probe (docs/sdc.md, "The confirming probe's time")
MIN_CONFIRM_BUDGET_S = 8.0
#: a confirmation ends by this share of the check's timeout, counted from the runner's start
#: (``ctx.remaining_s``; the rest, before the deadline, is for reading and writing)
_BUDGET_SHARE = 0.8


@dataclass(frozen=True)
class Params:
    """The check's parameters (a suite's ``params``), validated by :meth:`parse`."""

    spool_dir: str | None = None  # None: config spool_dir's sdc/
    confirm: bool = True  # confirm a job's report with the agent's own probe
    confirm_repeats: int = DEFAULT_CONFIRM_REPEATS
    confirm_timeout_s: float = DEFAULT_CONFIRM_TIMEOUT_S
    confirm_retry_s: float = DEFAULT_CONFIRM_RETRY_S

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Params:
        """ValueError naming the key and what was expected."""
        r = Reader("sdc_spool", raw, cls)
        return cls(
            spool_dir=r.optional_string("spool_dir"),
            confirm=r.flag("confirm"),
            confirm_repeats=r.integer("confirm_repeats", 1),
            confirm_timeout_s=r.positive("confirm_timeout_s"),
            confirm_retry_s=r.number("confirm_retry_s", at_least=0),
        )


def spool_dir(ctx: CheckContext) -> Path:
    given = ctx.typed_params(Params).spool_dir
    return Path(given) if given else ctx.config.spool_dir / "sdc"


def cursor_path(state_dir: Path) -> Path:
    return state_dir / "sdc" / "spool-cursor.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd = os.open(
        path.with_suffix(".lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600
    )
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _empty() -> dict[str, Any]:
    return {"schema": CURSOR_SCHEMA, "ingested": {}, "standing": [], "pending": {}}


def _load(path: Path) -> tuple[dict[str, Any], str | None]:
    if not path.exists():
        return _empty(), None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != CURSOR_SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {CURSOR_SCHEMA!r}")
        cursor: dict[str, Any] = {
            "schema": CURSOR_SCHEMA,
            "ingested": dict(data["ingested"]),
            "standing": [],
            "pending": dict(data.get("pending") or {}),
        }
        for fault in data["standing"]:
            if fault.get("confirmed_by") == "agent":
                cursor["standing"].append(fault)
            else:
                # written by an agent that believed the spool: a report until probed again
                cursor["pending"].setdefault(
                    fault["target"],
                    {
                        "gpu_uuid": fault.get("gpu_uuid"),
                        "uid": fault.get("reported_by_uid"),
                        "pids": [],
                        "file": fault.get("file"),
                        "detail": fault.get("detail", ""),
                        "verdict_at": fault.get("verdict_at"),
                        "reported_at": fault.get("graded_at"),
                        "next_try": 0.0,
                        "tries": 0,
                    },
                )
        return cursor, None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as err:
        return _empty(), (
            f"cursor {path} unreadable ({err}); every verdict in the spool is read again"
        )


def clear_standing(state_dir: Path) -> int:
    """``set-healthy``: forget the standing SDC faults and pending reports; returns how many
    there were. The spool files stay (they are evidence) and are not read again."""
    path = cursor_path(state_dir)
    if not path.exists():
        return 0
    with _locked(path):
        cursor, _ = _load(path)
        n = len(cursor["standing"]) + len(cursor["pending"])
        cursor["standing"], cursor["pending"] = [], {}
        write_json(path, cursor)
    return n


def _when(ts: float | None) -> str:
    if ts is None:
        return "an unknown time"
    return utc_iso(ts)


def map_target(
    ctx: CheckContext, device: str, evidence: dict[str, Any]
) -> tuple[str, str | None, str]:
    """(target, GPU UUID or None, note) for a verdict's device as the training job named it."""
    by_uuid = {g.uuid: g for g in ctx.inventory.gpus}
    uuid = evidence.get("gpu_uuid")
    if isinstance(uuid, str) and uuid in by_uuid:
        return f"gpu:{by_uuid[uuid].index}", uuid, ""
    if device.startswith("cuda:") and device[5:].isdigit() and len(device) < 12:
        index = int(device[5:])
        info = next((g for g in ctx.inventory.gpus if g.index == index), None)
        return (
            f"gpu:{index}",
            info.uuid if info else None,
            f" (the job's device {device}; under CUDA_VISIBLE_DEVICES its index may differ "
            "from the node's)",
        )
    return "node", None, f" (device {device[:64]!r})"


# -- who runs on which GPU ------------------------------------------------------------------------


def gpu_users(ctx: CheckContext) -> tuple[dict[int, dict[int, list[int]]], str | None]:
    """GPU index -> {uid: [pids]} of the compute processes NVML lists on it (each pid's uid
    from /proc), or ({}, why) when the GPUs cannot be asked."""
    import psutil

    if ctx.gpu is None or ctx.gpu.unavailable_reason:
        return (
            {},
            f"the GPUs cannot be queried ({ctx.gpu.unavailable_reason if ctx.gpu else 'no GPU backend'})",
        )
    try:
        devices = list(ctx.gpu.devices())
    except GpuError as err:
        return {}, f"the GPUs cannot be listed ({type(err).__name__}: {err})"
    out: dict[int, dict[int, list[int]]] = {}
    problems = []
    for dev in devices:
        try:
            listed = dev.compute_processes()
        except GpuError as err:
            problems.append(f"gpu:{dev.index}: {type(err).__name__}: {err}")
            continue
        users = out.setdefault(dev.index, {})
        for listed_proc in listed:
            try:
                uid = psutil.Process(listed_proc.pid).uids().effective
            except (psutil.Error, ValueError):
                continue  # exited, or a pid of another PID namespace: nobody to vouch for
            users.setdefault(uid, []).append(listed_proc.pid)
    return out, "; ".join(problems) or None


def _vouch(
    uid: int, target: str, users: dict[int, dict[int, list[int]]], why_not: str | None
) -> tuple[list[int], str]:
    """(the writer's pids on the target GPU, or [] with the reason it is not believed)."""
    if not target.startswith("gpu:"):
        return [], "the verdict names no GPU of this node"
    index = int(target[4:])
    if index not in users:
        return [], f"NVML's process list of {target} is not available ({why_not or 'no such GPU'})"
    pids = sorted(users[index].get(uid, []))
    if pids:
        return pids, ""
    others = sorted(users[index])
    return [], (
        f"uid {uid} runs no compute process on {target} (NVML lists processes of "
        f"{'uid ' + ', '.join(map(str, others)) if others else 'nobody'} there)"
    )


# -- the run --------------------------------------------------------------------------------------


def run(ctx: CheckContext) -> list[Result]:
    from node_agent.sdc import spool as sdc_lib

    if ctx.state_dir is None:
        return [
            ctx.skip(
                f"state directory {ctx.config.state_dir} is not writable: training "
                "jobs' SDC verdicts cannot be tracked (set state_dir in the config)",
                metric="sdc_spool",
            )
        ]
    spool = spool_dir(ctx)
    path = cursor_path(ctx.state_dir)
    now = time.time()
    out: list[Result] = []
    with _locked(path):
        cursor, problem = _load(path)
        present = sdc_lib.spool_names(spool)
        # forget files no longer in the spool: the cursor stays as small as the spool
        cursor["ingested"] = {k: v for k, v in cursor["ingested"].items() if k in present}
        errors: list[tuple[Path, str]] = []
        new = sdc_lib.read_verdicts(spool, errors, skip=cursor["ingested"])
        groups, passes = _ingest(ctx, cursor, new, now)
        out.extend(_unreadable_results(ctx, spool, errors, cursor, now))
        out.extend(_report_results(ctx, groups))
        confirmed = _confirm(ctx, cursor, now, out)
        out.extend(_standing_results(ctx, cursor, confirmed))
        write_json(path, cursor)
    if not out:
        out.append(
            ctx.result(
                "node",
                "sdc_spool",
                Status.PASS,
                f"SDC spool {spool}: {len(new)} new verdict(s) ({passes} pass), none failing"
                + (f"; note: {problem}" if problem else ""),
                value=len(new),
                unit="verdicts",
                spool_dir=str(spool),
                cursor=str(path),
            )
        )
    return out


_Groups = dict[tuple[str, str], list[tuple[Any, str, str | None]]]


def _ingest(
    ctx: CheckContext, cursor: dict[str, Any], new: list[SpooledVerdict], now: float
) -> tuple[_Groups, int]:
    """The new verdicts recorded in the cursor: a confirmed one whose writer runs on its GPU
    becomes pending (for the agent's own probe), the others are grouped by (target, kind) for
    their reports; also how many passed."""
    users, users_problem = (
        gpu_users(ctx) if any(s.verdict.status == "confirmed" for s in new) else ({}, None)
    )
    groups: _Groups = {}
    passes = 0
    for sv in new:
        v = sv.verdict
        target, uuid, note = map_target(ctx, v.device, v.evidence)
        cursor["ingested"][sv.path.name] = {
            "status": v.status,
            "target": target,
            "at": now,
            "uid": sv.uid,
        }
        if v.status == "pass":
            passes += 1
            continue
        if v.status == "confirmed":
            pids, why = _vouch(sv.uid, target, users, users_problem)
            if pids:
                cursor["pending"][target] = {
                    "gpu_uuid": uuid,
                    "uid": sv.uid,
                    "pids": pids,
                    "file": sv.path.name,
                    "detail": v.detail[:500] + note,
                    "verdict_at": v.timestamp,
                    "reported_at": now,
                    "next_try": 0.0,
                    "tries": 0,
                }
                continue
            groups.setdefault((target, "unverified"), []).append((sv, note + f"; {why}", uuid))
            continue
        groups.setdefault((target, v.status), []).append((sv, note, uuid))
    return groups, passes


def _unreadable_results(
    ctx: CheckContext,
    spool: Path,
    errors: list[tuple[Path, str]],
    cursor: dict[str, Any],
    now: float,
) -> list[Result]:
    """A WARN for each spool file (or the spool itself) that could not be read; a file is
    marked ingested so that it is reported once."""
    out = []
    for file, reason in errors:
        if file == spool:  # about the directory (too many files): said, nothing ingested
            out.append(
                ctx.result(
                    "node",
                    "sdc_spool_unreadable",
                    Status.WARN,
                    f"SDC spool {spool}: {reason}",
                    file=str(file),
                )
            )
            continue
        cursor["ingested"][file.name] = {"status": "unreadable", "target": "node", "at": now}
        out.append(
            ctx.result(
                "node",
                "sdc_spool_unreadable",
                Status.WARN,
                f"SDC spool file {file} is not a valid verdict ({reason}); "
                "it was not written by node_agent.sdc.write_verdict, or was "
                "damaged: inspect and remove it (reported once)",
                file=str(file),
            )
        )
    return out


_REPORTS = {
    "unverified": (
        "sdc_report_unverified",
        "a spooled verdict says silent data corruption was confirmed, but its writer "
        "cannot be vouched for, so it is not believed and nothing is done",
    ),
    "transient": (
        "sdc_transient",
        "a training job's probe saw a mismatch its re-run did not "
        "repeat (transient; kept as evidence)",
    ),
    "error": ("sdc_probe_error", "a training job's SDC probe could not run"),
}


def _report_results(ctx: CheckContext, groups: dict[Any, Any]) -> list[Result]:
    """One WARN per (target, kind) of the reports that are not confirmations to probe."""
    out = []
    for (target, kind), items in sorted(groups.items()):
        metric, what = _REPORTS[kind]
        first, note, uuid = items[0]
        v = first.verdict
        writers = sorted({sv.uid for sv, *_ in items})
        out.append(
            ctx.result(
                target,
                metric,
                Status.WARN,
                f"{target}: {what}: {v.detail[:300]}{note}; written by uid "
                f"{', '.join(map(str, writers))}; {len(items)} new verdict(s), first at "
                f"{_when(v.timestamp)} in {first.path.name}",
                value=len(items),
                unit="verdicts",
                **v.headline(),
                gpu_uuid=uuid,
                source="spool (a training user's report)",
                writer_uids=writers,
                files=[sv.path.name for sv, *_ in items][:20],
                verdicts=[sv.verdict.to_dict() for sv, *_ in items][:5],
            )
        )
    return out


# -- the agent's own probe ------------------------------------------------------------------------


def _confirm(ctx: CheckContext, cursor: dict[str, Any], now: float, out: list[Result]) -> set[str]:
    """Probe the GPUs with pending reports; move confirmed ones to ``standing``; the targets
    the agent confirmed in this run."""
    current = {f"gpu:{g.index}": g.uuid for g in ctx.inventory.gpus}
    for target in list(cursor["pending"]):
        uuid = cursor["pending"][target].get("gpu_uuid")
        if target not in current or (uuid is not None and current[target] != uuid):
            del cursor["pending"][target]  # the GPU was replaced: the report went with it
    due = sorted(t for t, p in cursor["pending"].items() if p.get("next_try", 0.0) <= now)
    if not cursor["pending"]:
        return set()
    params = ctx.typed_params(Params)
    if not params.confirm:
        outcome = {t: ("pending", "confirmation is off (params.confirm: false)") for t in due}
    elif due:
        budget = min(
            params.confirm_timeout_s,
            ctx.remaining_s((1.0 - _BUDGET_SHARE) * ctx.timeout_s),
        )
        outcome = own_probe(ctx, [int(t[4:]) for t in due], budget)
    else:
        outcome = {}
    confirmed = set()
    retry_s = params.confirm_retry_s
    for target, report in sorted(cursor["pending"].items()):
        result, detail = outcome.get(
            target, ("pending", f"the next probe is due at {_when(report.get('next_try'))}")
        )
        if result == "confirmed":
            confirmed.add(target)
            cursor["standing"].append(
                {
                    "target": target,
                    "gpu_uuid": report.get("gpu_uuid"),
                    "confirmed_by": "agent",
                    "reported_by_uid": report.get("uid"),
                    "file": report.get("file"),
                    "detail": detail,
                    "report": report.get("detail", ""),
                    "verdict_at": now,
                    "graded_at": now,
                }
            )
        if result in ("confirmed", "clean"):
            del cursor["pending"][target]
        elif target in outcome:
            report["tries"] = int(report.get("tries", 0)) + 1
            report["next_try"] = now + retry_s
        out.append(_confirmation_result(ctx, target, report, result, detail))
    return confirmed


def _confirmation_result(
    ctx: CheckContext, target: str, report: dict[str, Any], result: str, detail: str
) -> Result:
    """What the agent's own probe made of a training job's report on ``target``: confirmed
    (FAIL), clean (a WARN kept as evidence, not acted on) or still awaited (WARN)."""
    who = (
        f"a training job of uid {report.get('uid')} (pid "
        f"{', '.join(map(str, report.get('pids') or [])) or '?'}, running on {target})"
    )
    said = (
        f"{who} reported silent data corruption confirmed by its probe at "
        f"{_when(report.get('verdict_at'))}: {report.get('detail', '')[:300]}"
    )
    common: dict[str, Any] = dict(
        gpu_uuid=report.get("gpu_uuid"),
        reporter_uid=report.get("uid"),
        reporter_pids=report.get("pids"),
        file=report.get("file"),
    )
    if result == "confirmed":
        return ctx.result(
            target,
            "sdc_confirmed",
            Status.FAIL,
            f"{target}: silent data corruption confirmed by the agent's "
            f"own probe ({detail}), after {said}",
            value=1,
            unit="verdicts",
            source="agent probe",
            **common,
        )
    if result == "clean":
        return ctx.result(
            target,
            "sdc_reported",
            Status.WARN,
            f"{target}: {said}; the agent's own probe did not confirm it "
            f"({detail}): not acted on, kept as evidence",
            value=1,
            unit="verdicts",
            source="spool (not confirmed)",
            **common,
        )
    return ctx.result(
        target,
        "sdc_reported",
        Status.WARN,
        f"{target}: {said}; awaiting the agent's own probe before any action ({detail})",
        value=1,
        unit="verdicts",
        source="spool (awaiting the agent's probe)",
        tries=report.get("tries", 0),
        **common,
    )


def own_probe(ctx: CheckContext, indices: list[int], budget_s: float) -> dict[str, tuple[str, str]]:
    """Run the agent's ``sdc`` check on ``indices`` in a child process (torch stays out of this
    process) within ``budget_s``; target -> ("confirmed"|"clean"|"pending", detail).

    The child is the check child (``checking/child.py``: the daemon's too), given this run's
    configuration and node, and the periodic suite's ``sdc`` params (so ``min_free_mib`` keeps
    it from pushing a job out of GPU memory) with this check's GPUs and ``confirm_repeats``."""
    targets = [f"gpu:{i}" for i in indices]
    if budget_s < MIN_CONFIRM_BUDGET_S:
        why = (
            f"{budget_s:.0f} s left of this check's timeout_s {ctx.timeout_s:g}, too little "
            "for a probe: raise sdc_spool's timeout_s in the suite"
        )
        return {t: ("pending", why) for t in targets}
    timeout_s = max(1.0, budget_s - 5.0)
    spec = child.ChildSpec(
        check="sdc",
        timeout_s=timeout_s,
        params={"gpus": list(indices), "repeats": ctx.typed_params(Params).confirm_repeats},
        mode="service",
        config=proc.absolute_config(ctx.config.data),
        node=ctx.ports.node,
        params_from_suite="periodic",
    )
    answer = child.call_child(spec, grace_s=budget_s - timeout_s)
    if answer.results is None:
        why = f"the probe did not run: {answer.failure}"
        return {t: ("pending", why) for t in targets}
    return {t: _probe_outcome(t, answer.results) for t in targets}


def _probe_outcome(target: str, results: list[Result]) -> tuple[str, str]:
    """What the agent's ``sdc`` probe found on ``target``."""
    mine = [r for r in results if r.target == target and r.check == "sdc"]
    bad = next(
        (r for r in mine if r.metric == "sdc_confirmed" and r.status is Status.FAIL),
        None,
    )
    if bad is not None:
        return "confirmed", bad.detail[:500]
    if mine and all(r.status in (Status.PASS, Status.WARN) for r in mine):
        return "clean", "; ".join(r.detail for r in mine)[:500]
    why = "; ".join(r.detail for r in mine) or "no result for it"
    return "pending", f"the probe could not run on {target}: {why[:400]}"


def _standing_results(ctx: CheckContext, cursor: dict[str, Any], fresh: set[str]) -> list[Result]:
    """SDC the agent's own probe confirmed in earlier runs, still standing while their GPU is
    in the node."""
    current = {f"gpu:{g.index}": g.uuid for g in ctx.inventory.gpus}
    keep, out = [], []
    by_target: dict[str, list[dict[str, Any]]] = {}
    for fault in cursor["standing"]:
        uuid = fault.get("gpu_uuid")
        if uuid is not None and current.get(fault["target"]) not in (None, uuid):
            continue  # the GPU at that index was replaced: the fault went with it
        keep.append(fault)
        by_target.setdefault(fault["target"], []).append(fault)
    cursor["standing"] = keep
    for target, faults in sorted(by_target.items()):
        if target in fresh:
            continue  # this run's confirmation already names it
        first = faults[0]
        out.append(
            ctx.result(
                target,
                "sdc_confirmed",
                Status.FAIL,
                f"{target}: silent data corruption confirmed by the agent's own probe at "
                f"{_when(first['graded_at'])} ({first.get('detail', '')}), still standing: it stays "
                f"FAULT until the GPU is replaced (UUID {first.get('gpu_uuid') or 'unknown'}) or an "
                "operator runs `node-agent set-healthy` after a repair",
                value=len(faults),
                unit="verdicts",
                gpu_uuid=first.get("gpu_uuid"),
                source="agent probe (standing)",
                reporter_uid=first.get("reported_by_uid"),
                files=[f.get("file") for f in faults][:20],
            )
        )
    return out
