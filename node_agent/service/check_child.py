"""One check in a child process, for the daemon: a function call across a process boundary.

The daemon runs some checks (``daemon.subprocess_checks``) in a child: compute checks import
torch (hundreds of MB resident) and the daemon stays small by never importing it, and a check
that wedges in the driver takes only the child with it. The interface is a function's, not a
command line's:

- :func:`run_in_child` (the daemon's side) starts ``python -P -m node_agent.service.check_child``
  in :data:`node_agent.proc.CHILD_CWD` and writes one :class:`ChildSpec` to its stdin as JSON:
  ``{"check", "params", "timeout_s", "mode", "config", "reopen_args", "params_from_suite"}``
  (``config`` is the caller's configuration data with its paths made absolute;
  ``reopen_args`` the arguments that reopen the caller's node, ``ports.reopen_args``:
  ``["--simulate", "/abs/node.yaml"]`` for a stand-in node, empty for this host;
  ``params_from_suite`` a suite whose entry for the check gives the params that ``params``
  then override, or null).
- A check that needs a probe of another check (``sdc_spool`` confirming a report with ``sdc``)
  starts the same child by its module name and writes the same JSON: no check imports this
  module.
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
    reopen_args: tuple[str, ...] = ()  # ports.reopen_args of the caller's node
    params_from_suite: str | None = None  # the suite whose entry for the check ``params`` amend

    def to_json(self) -> str:
        return json.dumps(
            {
                "check": self.check,
                "params": self.params,
                "timeout_s": self.timeout_s,
                "mode": self.mode,
                "config": self.config,
                "reopen_args": list(self.reopen_args),
                "params_from_suite": self.params_from_suite,
            }
        )

    @property
    def stand_in(self) -> str | None:
        """The file describing the stand-in node ``reopen_args`` names (None: this host)."""
        args = list(self.reopen_args)
        if not args:
            return None
        if len(args) != 2 or args[0] != "--simulate" or not os.path.isabs(args[1]):
            raise ValueError(
                f"the check spec's 'reopen_args' must be empty or ['--simulate', an absolute "
                f"path], not {args!r}"
            )
        return args[1]

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        """Parse the spec; ValueError names what is wrong."""
        data = json.loads(text)
        if not isinstance(data, dict):
            raise ValueError(f"the check spec must be a JSON object, not {type(data).__name__}")
        check, timeout_s = data.get("check"), data.get("timeout_s")
        params, config = data.get("params") or {}, data.get("config") or {}
        reopen, mode = data.get("reopen_args") or [], data.get("mode", "service")
        suite = data.get("params_from_suite")
        if not isinstance(check, str) or not check:
            raise ValueError("the check spec has no 'check' (a registered check's name)")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
            raise ValueError(f"the check spec's 'timeout_s' must be a number, not {timeout_s!r}")
        if not isinstance(params, dict) or not isinstance(config, dict):
            raise ValueError("the check spec's 'params' and 'config' must be JSON objects")
        if not isinstance(reopen, list) or not all(isinstance(a, str) for a in reopen):
            raise ValueError("the check spec's 'reopen_args' must be a list of strings")
        if suite is not None and not isinstance(suite, str):
            raise ValueError("the check spec's 'params_from_suite' must be a suite name or null")
        if mode not in ("delivery", "service"):
            raise ValueError(f"the check spec's 'mode' must be delivery or service, not {mode!r}")
        spec = cls(check, float(timeout_s), params, mode, config, tuple(reopen), suite)
        spec.stand_in  # noqa: B018 - validates reopen_args now, with the others
        return spec


def run_spec(spec: ChildSpec) -> list[Result]:
    """Run the spec's check in this process, as the daemon would (the child's body)."""
    from node_agent.config import config_from_dict
    from node_agent.environment import open_environment
    from node_agent.runner import FORKSERVER_CHECKS, run_check
    from node_agent.suite import CheckSpec

    config = config_from_dict(spec.config, source="(the parent's configuration)")
    params = spec.params
    if spec.params_from_suite is not None:
        params = _amended(_suite_params(config, spec.params_from_suite, spec.check), params)
    if spec.check in FORKSERVER_CHECKS:
        proc.start_forkserver_in_child_cwd()
    env = open_environment(config, spec.stand_in)
    try:
        return run_check(CheckSpec(spec.check, spec.timeout_s, params), env, spec.mode)
    finally:
        env.close()


def _suite_params(config: Any, suite_name: str, check: str) -> dict[str, Any]:
    """The params of ``check``'s entry in the suite (a deep copy); {} when the suite has none
    or does not load."""
    from node_agent.resources import suites_dir
    from node_agent.suite import load_suite
    from node_agent.yamlfile import ConfigError

    try:
        suite = load_suite(suite_name, suites_dir(config))
    except ConfigError:
        return {}
    entry = next((c for c in suite.checks if c.check == check), None)
    return json.loads(json.dumps(entry.params)) if entry is not None else {}


def _amended(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """``base`` with ``overrides`` applied to its params and to its stand-in section, so an
    override holds on this host and on a stand-in node alike."""
    out = {**base, **overrides}
    from node_agent.suite import STAND_IN_OVERLAY

    stand_in = base.get(STAND_IN_OVERLAY)
    if isinstance(stand_in, dict):
        out[STAND_IN_OVERLAY] = {**stand_in, **overrides}
    return out


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


def run_in_child(spec: ChildSpec, grace_s: float = GRACE_S) -> list[Result]:
    """Run ``spec`` in a child Python and return its results; a child that crashed, hung or
    wrote something unreadable is one ``error`` result that says so. The child is killed
    ``grace_s`` after the check's own timeout."""
    argv = proc.python_module_argv(__name__)
    done = proc.run(
        argv, timeout_s=spec.timeout_s + grace_s, cwd=proc.CHILD_CWD, input_text=spec.to_json()
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
