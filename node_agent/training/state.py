"""What ``training_progress`` remembers between runs, and the hang evidence it leaves behind.

``<state_dir>/hang/state.json`` keeps, per process (pid and start ticks, so a reused pid starts
fresh): since when its signals agree on a hang, since when it straggles, and the evidence file
of a hang already reported; and the heartbeat spool files already reported as unusable, so
each is reported once. ``<state_dir>/hang/evidence/`` receives one JSON file per job and
hang episode, with every process of the job, every signal and the full stacks: what the people
who debug the hang need after the job was restarted. The newest ``KEEP_EVIDENCE`` files stay.

A state file that is not ours (corrupt, truncated, another schema) is moved aside to
``state.json.corrupt-<time>`` (nothing is lost) and the check starts from an empty memory,
saying so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from pathlib import Path
from typing import Any

from node_agent.atomic_file import write_json
from node_agent.model import utc_stamp

SCHEMA = "node-agent.hang-state/1"
KEEP_EVIDENCE = 200
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def process_key(pid: int, start_ticks: int | None) -> str:
    return f"{pid}:{start_ticks if start_ticks is not None else '?'}"


class HangState:
    """Load with :meth:`load`, change ``processes[key]`` dicts, then :meth:`save` (atomic)."""

    def __init__(
        self,
        directory: Path,
        processes: dict[str, dict[str, Any]] | None = None,
        problem: str | None = None,
        bad_files: dict[str, str] | None = None,
    ) -> None:
        self.directory = directory
        self.processes = processes or {}
        self.problem = problem  # set when the file on disk could not be used
        self.bad_files = bad_files or {}  # spool file name -> what was reported about it

    @property
    def path(self) -> Path:
        return self.directory / "state.json"

    @classmethod
    def load(cls, directory: Path, now: float) -> HangState:
        path = directory / "state.json"
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            if (
                not isinstance(data, dict)
                or data.get("schema") != SCHEMA
                or not isinstance(data.get("processes"), dict)
            ):
                raise ValueError(f"not a {SCHEMA} file")
            bad = data.get("bad_files")
            return cls(
                directory,
                {k: v for k, v in data["processes"].items() if isinstance(v, dict)},
                bad_files={str(k): str(v) for k, v in bad.items()}
                if isinstance(bad, dict)
                else None,
            )
        except FileNotFoundError:
            return cls(directory)
        except (OSError, ValueError) as err:
            aside = path.with_name(f"state.json.corrupt-{int(now)}")
            with contextlib.suppress(OSError):
                os.replace(path, aside)
            return cls(
                directory,
                problem=(
                    f"hang state {path} was unreadable ({type(err).__name__}: {err}); moved to "
                    f"{aside.name} and started afresh: signals that must hold across runs start "
                    "counting again"
                ),
            )

    def keep_only(self, keys: set[str]) -> None:
        """Forget processes that are gone."""
        self.processes = {k: v for k, v in self.processes.items() if k in keys}

    def new_bad_files(self, found: list[tuple[Path, str]]) -> list[tuple[Path, str]]:
        """Of this run's unusable spool files, those not reported before with the same reason;
        names no longer unusable are forgotten (a file fixed and broken again is new)."""
        now = {path.name: (path, reason) for path, reason in found}
        fresh = [item for name, item in sorted(now.items()) if self.bad_files.get(name) != item[1]]
        self.bad_files = {name: reason for name, (_, reason) in now.items()}
        return fresh

    def save(self) -> None:
        write_json(
            self.path, {"schema": SCHEMA, "processes": self.processes, "bad_files": self.bad_files}
        )

    def write_evidence(self, job: str | None, now: float, evidence: dict[str, Any]) -> Path:
        """One hang episode of one job as ``evidence/<UTC time>-<job>.json``; returns the path."""
        stamp = utc_stamp(now)
        name = f"{stamp}-{_UNSAFE.sub('_', job or 'unknown-job')[:80]}.json"
        path = self.directory / "evidence" / name
        write_json(path, evidence)
        old = sorted(path.parent.glob("*.json"))[:-KEEP_EVIDENCE]
        for stale in old:
            with contextlib.suppress(OSError):
                stale.unlink()
        return path
