"""The check child's entry point (``python -P -m node_agent.service.check_child``): one check
run for a caller in a child process, on the node its request names.

The protocol, both ends, is :mod:`node_agent.checking.child` (a typed :class:`ChildSpec` in on
stdin, the results out on stdout, the exit status saying ran, refused or crashed); this module
is what the child does with a request: open the node (``open_environment_for``, from the
request's :class:`~node_agent.checking.child.NodeSpec`) and run the check through the runner,
its timeout, a crash or a hang becoming ``error`` results as in the daemon. It sits above the
runner and the environment, which it needs; nothing imports it, callers start it by name.
"""

from __future__ import annotations

import json
import sys
from typing import Any

from node_agent import proc
from node_agent.checking.child import ChildSpec, serve
from node_agent.model import Result


def run_spec(spec: ChildSpec) -> list[Result]:
    """Run the spec's check in this process, as the daemon would (the child's body)."""
    from node_agent.config import config_from_dict
    from node_agent.environment import open_environment_for
    from node_agent.runner import FORKSERVER_CHECKS, run_check
    from node_agent.suite import CheckSpec

    config = config_from_dict(spec.config, source="(the parent's configuration)")
    params = spec.params
    if spec.params_from_suite is not None:
        params = _amended(_suite_params(config, spec.params_from_suite, spec.check), params)
    if spec.check in FORKSERVER_CHECKS:
        proc.start_forkserver_in_child_cwd()
    env = open_environment_for(config, spec.node)
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
    return serve(run_spec)


if __name__ == "__main__":
    sys.exit(main())
