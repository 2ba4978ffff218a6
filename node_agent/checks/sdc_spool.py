"""Check ``sdc_spool``: grade the SDC verdicts that training jobs wrote to the spool.

Training jobs run ``node_agent.sdc.SdcProbe``, which writes every non-pass verdict atomically to
``<state_dir>/spool/sdc/`` (see ``docs/sdc.md``). This check reads the verdicts it has not read
before (``sdc.read_spool_files``: temp files of a writer killed mid-write are never opened) and
grades them:

- ``confirmed`` -> ``sdc_confirmed`` ``fail`` on the GPU (grade FAULT);
- ``transient`` -> ``sdc_transient`` ``warn`` (WARN);
- ``error`` (the probe could not run inside the job) -> ``sdc_probe_error`` ``error``;
- a ``.json`` file that is not a valid verdict -> ``sdc_spool_unreadable`` ``warn``, once.

What was read is recorded in a cursor file, ``<state_dir>/sdc/spool-cursor.json`` (updated
under an ``flock`` so the daemon and a Slurm health check never ingest the same file twice), so
each verdict file is graded once. The one exception is deliberate: a *confirmed* verdict stays
standing — every later run reports it again as a FAULT — until the GPU it names is replaced
(its UUID changes) or an operator clears it, because a GPU that computed wrong does not heal and
a later "HEALTHY" must not hand it back to training. Transients and errors are reported once.
To clear after a repair that kept the GPU: delete the spool files and the cursor file.

The cursor forgets a file once it is gone from the spool, so it stays as small as the spool
(which holds only non-pass verdicts by default). Files are left in place as evidence.

GPU mapping: a verdict carrying ``evidence['gpu_uuid']`` maps to the inventory GPU with that
UUID; otherwise ``cuda:N`` maps to ``gpu:N``, and the detail says that this is the job's CUDA
index (under ``CUDA_VISIBLE_DEVICES`` it may not be the node's index).

Params: ``spool_dir`` (default ``<state_dir>/spool/sdc``).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from node_agent.atomic_file import write_json
from node_agent.checks import CheckContext
from node_agent.model import Result, Status

CURSOR_SCHEMA = "node-agent.sdc-spool-cursor/1"
_METRIC = {"confirmed": ("sdc_confirmed", Status.FAIL), "transient": ("sdc_transient", Status.WARN),
           "error": ("sdc_probe_error", Status.ERROR)}


def spool_dir(ctx: CheckContext) -> Path | None:
    if ctx.params.get("spool_dir"):
        return Path(ctx.params["spool_dir"])
    return ctx.state_dir / "spool" / "sdc" if ctx.state_dir is not None else None


def cursor_path(state_dir: Path) -> Path:
    return state_dir / "sdc" / "spool-cursor.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _load(path: Path) -> tuple[dict[str, Any], str | None]:
    empty: dict[str, Any] = {"schema": CURSOR_SCHEMA, "ingested": {}, "standing": []}
    if not path.exists():
        return empty, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if data.get("schema") != CURSOR_SCHEMA:
            raise ValueError(f"schema {data.get('schema')!r}, expected {CURSOR_SCHEMA!r}")
        return {"schema": CURSOR_SCHEMA, "ingested": dict(data["ingested"]),
                "standing": list(data["standing"])}, None
    except (OSError, ValueError, KeyError, TypeError) as err:
        return empty, (f"cursor {path} unreadable ({err}); every verdict in the spool is read "
                       "again")


def _when(ts: float) -> str:
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def map_target(ctx: CheckContext, device: str, evidence: dict[str, Any]) -> tuple[str, str | None, str]:
    """(target, GPU UUID or None, note) for a verdict's device as the training job named it."""
    by_uuid = {g.uuid: g for g in ctx.inventory.gpus}
    uuid = evidence.get("gpu_uuid")
    if isinstance(uuid, str) and uuid in by_uuid:
        return f"gpu:{by_uuid[uuid].index}", uuid, ""
    if device.startswith("cuda:") and device[5:].isdigit():
        index = int(device[5:])
        info = next((g for g in ctx.inventory.gpus if g.index == index), None)
        return (f"gpu:{index}", info.uuid if info else None,
                f" (the job's device {device}; under CUDA_VISIBLE_DEVICES its index may differ "
                "from the node's)")
    return "node", None, f" (device {device})"


def run(ctx: CheckContext) -> list[Result]:
    from node_agent.sdc import spool as sdc_lib
    if ctx.state_dir is None:
        return [ctx.skip(f"state directory {ctx.config.state_dir} is not writable: training "
                         "jobs' SDC verdicts cannot be tracked (set state_dir in the config)",
                         metric="sdc_spool")]
    spool = spool_dir(ctx)
    assert spool is not None
    path = cursor_path(ctx.state_dir)
    now = time.time()
    out: list[Result] = []
    with _locked(path):
        cursor, problem = _load(path)
        present = sdc_lib.spool_names(spool)
        # forget files no longer in the spool: the cursor stays as small as the spool
        cursor["ingested"] = {k: v for k, v in cursor["ingested"].items() if k in present}
        errors: list[tuple[Path, str]] = []
        new = [(v.path, v.verdict)
               for v in sdc_lib.read_verdicts(spool, errors, skip=cursor["ingested"])]
        groups: dict[tuple[str, str], list[tuple[Path, Any, str, str | None]]] = {}
        passes = 0
        for file, v in new:
            target, uuid, note = map_target(ctx, v.device, v.evidence)
            cursor["ingested"][file.name] = {"status": v.status, "target": target, "at": now}
            if v.status == "pass":
                passes += 1
                continue
            groups.setdefault((target, v.status), []).append((file, v, note, uuid))
            if v.status == "confirmed":
                cursor["standing"].append({
                    "file": file.name, "target": target, "gpu_uuid": uuid, "probe": v.probe,
                    "shape": list(v.shape), "dtype": v.dtype,
                    "mismatched_elements": v.mismatched_elements, "detail": v.detail + note,
                    "verdict_at": v.timestamp, "graded_at": now})
        for file, reason in errors:
            if file == spool:  # about the directory (too many files): said, nothing ingested
                out.append(ctx.result("node", "sdc_spool_unreadable", Status.WARN,
                                      f"SDC spool {spool}: {reason}", file=str(file)))
                continue
            cursor["ingested"][file.name] = {"status": "unreadable", "target": "node", "at": now}
            out.append(ctx.result("node", "sdc_spool_unreadable", Status.WARN,
                                  f"SDC spool file {file} is not a valid verdict ({reason}); "
                                  "it was not written by node_agent.sdc.write_verdict, or was "
                                  "damaged: inspect and remove it (reported once)",
                                  file=str(file)))
        out.extend(_new_results(ctx, groups))
        out.extend(_standing_results(ctx, cursor, {t for (t, s) in groups if s == "confirmed"}))
        write_json(path, cursor)
    if not out:
        out.append(ctx.result(
            "node", "sdc_spool", Status.PASS,
            f"SDC spool {spool}: {len(new)} new verdict(s) ({passes} pass), none failing"
            + (f"; note: {problem}" if problem else ""),
            value=len(new), unit="verdicts", spool_dir=str(spool), cursor=str(path)))
    return out


def _new_results(ctx: CheckContext, groups: dict) -> list[Result]:
    out = []
    for (target, status), items in sorted(groups.items()):
        metric, result_status = _METRIC[status]
        file, first, note, uuid = items[0]
        what = {"confirmed": "silent data corruption confirmed by a training job's probe",
                "transient": "a training job's probe saw a mismatch its re-run did not repeat "
                             "(transient; kept as evidence)",
                "error": "a training job's SDC probe could not run"}[status]
        out.append(ctx.result(
            target, metric, result_status,
            f"{target}: {what}: {first.detail}{note}; {len(items)} new verdict(s), first at "
            f"{_when(first.timestamp)} in {file.name}",
            value=len(items), unit="verdicts", probe=first.probe, shape=list(first.shape),
            dtype=first.dtype, mismatched_elements=first.mismatched_elements, gpu_uuid=uuid,
            source="spool", files=[f.name for f, *_ in items][:20],
            verdicts=[v.to_dict() for _, v, *_ in items][:5]))
    return out


def _standing_results(ctx: CheckContext, cursor: dict[str, Any], fresh: set[str]) -> list[Result]:
    """Confirmed verdicts of earlier runs, still standing while their GPU is in the node."""
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
            continue  # this run's new-verdict result already names it
        first = faults[0]
        out.append(ctx.result(
            target, "sdc_confirmed", Status.FAIL,
            f"{target}: silent data corruption confirmed by a training job's probe at "
            f"{_when(first['verdict_at'])} (first graded {_when(first['graded_at'])}), still "
            f"standing: {first['detail']}; it stays FAULT until the GPU is replaced (UUID "
            f"{first.get('gpu_uuid') or 'unknown'}) or the spool and cursor are cleared",
            value=len(faults), unit="verdicts", probe=first["probe"], shape=first["shape"],
            dtype=first["dtype"], mismatched_elements=first["mismatched_elements"],
            gpu_uuid=first.get("gpu_uuid"), source="spool (standing)",
            files=[f["file"] for f in faults][:20]))
    return out
