"""One check in a child process, for the daemon: a function call across a process boundary.

The daemon runs some checks (``daemon.subprocess_checks``) in a child: compute checks import
torch (hundreds of MB resident) and the daemon stays small by never importing it, and a check
that wedges in the driver takes only the child with it. The interface is a function's, not a
command line's:

- :func:`run_in_child` (the daemon's side) starts ``python -P -m node_agent.service.check_child``
  in :data:`node_agent.proc.CHILD_CWD` and writes one :class:`ChildSpec` to its stdin as JSON:
  ``{"check", "params", "timeout_s", "mode", "config", "scenario"}`` (``config`` is the daemon's
  configuration data with its paths made absolute; ``scenario`` the simulated node's file, or
  null).
- The child (:func:`main`) opens the environment, runs the check through the runner (its
  timeout, a crash or a hang become ``error`` results as in the daemon) and writes
  ``{"results": [Result.to_dict(), ...]}`` to stdout.
- Its exit status means only "ran" (0) or "crashed" (anything else, with stderr saying why).
  A child that does not end within the check's timeout plus :data:`GRACE_S` is killed, with
  its process group: a wedged driver call costs the child, never the daemon.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any

from node_agent import proc
from node_agent.model import Result, Status

#: beyond the check's own timeout: the child's start (imports, opening NVML) and its exit
GRACE_S = 60.0
#: exit status of a child that could not run the check (a bad spec, the environment would not
#: open): its stderr says why
CRASHED = 2


@dataclass(frozen=True)
class ChildSpec:
    """What the child runs: one check, as the daemon would run it."""

    check: str
    timeout_s: float
    params: dict[str, Any] = field(default_factory=dict)
    mode: str = "service"
    config: dict[str, Any] = field(default_factory=dict)  # Config.data, paths absolute
    scenario: str | None = None  # the simulated node's file (absolute), None on real hardware

    def to_json(self) -> str:
        return json.dumps(
            {
                "check": self.check,
                "params": self.params,
                "timeout_s": self.timeout_s,
                "mode": self.mode,
                "config": self.config,
                "scenario": self.scenario,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        """Parse the spec; ValueError names what is wrong."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"the check spec must be a JSON object, not {type(data).__name__}")
        check, timeout_s = data.get("check"), data.get("timeout_s")
        params, config = data.get("params") or {}, data.get("config") or {}
        scenario, mode = data.get("scenario"), data.get("mode", "service")
        if not isinstance(check, str) or not check:
            raise ValueError("the check spec has no 'check' (a registered check's name)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise ValueError(f"the check spec's 'timeout_s' must be a number, not {timeout_s!r}")
        if not isinstance(params, dict) or not isinstance(config, dict):
            raise ValueError("the check spec's 'params' and 'config' must be JSON objects")
        if scenario is not None and not isinstance(scenario, str):
            raise ValueError("the check spec's 'scenario' must be a path or null")
        if mode not in ("delivery", "service"):
            raise ValueError(f"the check spec's 'mode' must be delivery or service, not {mode!r}")
        return cls(check, float(timeout_s), params, mode, config, scenario)


def run_spec(spec: ChildSpec) -> list[Result]:
    """Run the spec's check in this process, as the daemon would (the child's body)."""
    from node_agent.config import config_from_dict
    from node_agent.environment import open_environment
    from node_agent.runner import FORKSERVER_CHECKS, run_check
    from node_agent.suite import CheckSpec

    config = config_from_dict(spec.config, source="(the daemon's configuration)")
    if spec.check in FORKSERVER_CHECKS:
        proc.start_forkserver_in_child_cwd()
    env = open_environment(config, spec.scenario)
    try:
        return run_check(CheckSpec(spec.check, spec.timeout_s, spec.params), env, spec.mode)
    finally:
        env.close()


def main() -> int:
    # stdout carries the results alone: while the check runs, whatever it or a process it
    # starts prints goes to stderr (file descriptor 1 points there until the answer)
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        spec = ChildSpec.from_json(sys.stdin.read())
        results = run_spec(spec)
    except Exception:  # noqa: BLE001 - the daemon reads the reason from stderr
        traceback.print_exc(limit=8)
        return CRASHED
    with answer:
        json.dump({"results": [r.to_dict() for r in results]}, answer)
    return 0


def run_in_child(spec: ChildSpec) -> list[Result]:
    """Run ``spec`` in a child Python and return its results; a child that crashed, hung or
    wrote something unreadable is one ``error`` result that says so."""
    argv = proc.python_module_argv(__name__)
    done = proc.run(
        argv, timeout_s=spec.timeout_s + GRACE_S, cwd=proc.CHILD_CWD, input_text=spec.to_json()
    )
    if done.ok:
        try:
            return [Result.from_dict(r) for r in json.loads(done.stdout)["results"]]
        except (ValueError, KeyError, TypeError) as err:
            detail = f"unreadable results from the child process: {err}"
    else:
        detail = done.describe_failure()
    return [
        Result(
            check=spec.check,
            target="node",
            metric="ran",
            status=Status.ERROR,
            detail=f"check {spec.check} in a child process failed: {detail}",
        )
    ]


if __name__ == "__main__":
    sys.exit(main())
