"""The check-child protocol: one check run in a child Python, as a function call across a
process boundary. Both ends of the wire are here, typed; nothing else spells it.

Why it lives in ``checking/``: its lowest user is a check (``sdc_spool`` confirms a job's
report with the agent's own ``sdc`` probe in a child, keeping torch out of its process), and a
check imports nothing above ``checking/`` (tests/unit/test_layout.py). The daemon
(``service/``) uses the same module from above. What the child *does* with a request (open
the node, run the check through the runner) needs the environment and the runner, so it is the
child's entry module, :data:`CHILD_MODULE`, started by its name: no module here imports it.

The wire:

- the caller (:func:`call_child`, or :func:`run_in_child` for the daemon) starts ``python -P -m``
  :data:`CHILD_MODULE` in :data:`node_agent.proc.CHILD_CWD` and writes one :class:`ChildSpec`
  to its stdin as a JSON object: ``{"check", "timeout_s", "params", "mode", "config", "node",
  "params_from_suite"}``. ``config`` is the caller's configuration data with its paths made
  absolute (``proc.absolute_config``); ``node`` the :class:`NodeSpec` of the caller's node,
  ``{"kind": "host"}`` or ``{"kind": "scenario", "path": "/abs/node.yaml"}`` (the node the
  environment opened, ``Node.spec``), never a command line; ``params_from_suite`` a suite whose
  entry for the check gives the params that ``params`` then override, or null.
- The child (:func:`serve`) reads the request as hostile input (it crossed a pipe): at most
  :data:`MAX_REQUEST_BYTES`, a JSON object with exactly the keys above (``check``,
  ``timeout_s`` and ``node`` required), a node of a known kind whose path is absolute. It runs
  the check and writes ``{"results": [Result.to_dict(), ...]}`` to stdout, nothing else.
- Its exit status: :data:`RAN` (0); :data:`REFUSED` (2, like the command line's configuration
  error): the request is invalid (a bad key or value, an unknown node kind, a relative path,
  a configuration or scenario that does not validate), nothing ran, stderr's last line says
  what is wrong; :data:`CRASHED` (1): anything else, with the traceback on stderr. A child that
  does not end within the check's timeout plus :data:`GRACE_S` is killed with its process
  group: a wedged driver call costs the child, never its caller.
"""

from __future__ import annotations

import json
import math
import os
import sys
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from node_agent import proc
from node_agent.model import Result, Status
from node_agent.yamlfile import ConfigError

#: the child's entry module: it opens the node a request names and runs the check
CHILD_MODULE = "node_agent.service.check_child"
#: beyond the check's own timeout: the child's start (imports, opening NVML) and its exit
GRACE_S = 60.0
#: exit statuses of the child (see the module's docstring)
RAN, CRASHED, REFUSED = 0, 1, 2
#: a request larger than this is refused unread (the configuration and params are a few KB)
MAX_REQUEST_BYTES = 4 << 20
_MAX_PATH = 4096

NodeKind = Literal["host", "scenario"]
Mode = Literal["delivery", "service"]
_NODE_KINDS: tuple[NodeKind, ...] = ("host", "scenario")
_MODES: tuple[Mode, ...] = ("delivery", "service")


@dataclass(frozen=True)
class NodeSpec:
    """Which node a child opens: this host (``kind="host"``), or the stand-in the scenario
    file at the absolute ``path`` describes (``kind="scenario"``). ValueError when the two do
    not fit together."""

    kind: NodeKind = "host"
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _NODE_KINDS:
            raise ValueError(
                f"the node's 'kind' must be one of {', '.join(_NODE_KINDS)}, not {self.kind!r}"
            )
        if self.kind == "host":
            if self.path is not None:
                raise ValueError(f"a node of kind 'host' takes no 'path' (given {self.path!r})")
            return
        path = self.path
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ValueError(
                f"a node of kind 'scenario' needs 'path', an absolute path to its scenario "
                f"file, not {path!r} (the child runs in {proc.CHILD_CWD})"
            )
        if "\0" in path or len(path) > _MAX_PATH:
            raise ValueError(f"the node's 'path' is not a usable file name: {path[:200]!r}")

    @classmethod
    def scenario(cls, path: str | os.PathLike[str]) -> NodeSpec:
        """The stand-in node ``path`` describes, made absolute against this process's working
        directory."""
        return cls("scenario", proc.absolute_path(path))

    @property
    def scenario_path(self) -> str | None:
        """What ``open_environment``'s ``simulate`` takes: the scenario file, or None."""
        return self.path

    def to_dict(self) -> dict[str, str]:
        return {"kind": self.kind} if self.path is None else {"kind": self.kind, "path": self.path}

    @classmethod
    def from_dict(cls, data: object) -> NodeSpec:
        """ValueError names what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"the request's 'node' must be an object, not {_kind_of(data)}")
        _no_other_keys("node", data, ("kind", "path"))
        kind = data.get("kind")
        if kind not in _NODE_KINDS:
            raise ValueError(
                f"the request's node 'kind' must be one of {', '.join(_NODE_KINDS)}, "
                f"not {kind!r:.80}"
            )
        return cls(cast(NodeKind, kind), data.get("path"))


#: this host
HOST = NodeSpec()


@dataclass(frozen=True)
class ChildSpec:
    """What the child runs: one check, as the daemon would run it, on the node ``node``."""

    check: str
    timeout_s: float
    params: dict[str, Any] = field(default_factory=dict)
    mode: Mode = "service"
    config: dict[str, Any] = field(default_factory=dict)  # Config.data, paths absolute
    node: NodeSpec = HOST
    params_from_suite: str | None = None  # the suite whose entry for the check ``params`` amend

    def to_json(self) -> str:
        return json.dumps(
            {
                "check": self.check,
                "timeout_s": self.timeout_s,
                "params": self.params,
                "mode": self.mode,
                "config": self.config,
                "node": self.node.to_dict(),
                "params_from_suite": self.params_from_suite,
            }
        )

    @classmethod
    def from_json(cls, text: str) -> ChildSpec:
        """Parse a request; ValueError names what is wrong."""
        try:
            data = json.loads(text)
        except RecursionError:
            raise ValueError("the request is nested too deeply to be a check spec") from None
        if not isinstance(data, dict):
            raise ValueError(f"the request must be a JSON object, not {_kind_of(data)}")
        _no_other_keys("request", data, _KEYS)
        check, timeout_s = data.get("check"), data.get("timeout_s")
        params, config = data.get("params", {}), data.get("config", {})
        mode, suite = data.get("mode", "service"), data.get("params_from_suite")
        if not isinstance(check, str) or not check:
            raise ValueError("the request has no 'check' (a registered check's name)")
        if (
            isinstance(timeout_s, bool)
            or not isinstance(timeout_s, (int, float))
            or not math.isfinite(timeout_s)
            or timeout_s <= 0
        ):
            raise ValueError(
                f"the request's 'timeout_s' must be a number of seconds above 0, not "
                f"{timeout_s!r:.80}"
            )
        if not isinstance(params, dict) or not isinstance(config, dict):
            raise ValueError("the request's 'params' and 'config' must be JSON objects")
        if mode not in _MODES:
            raise ValueError(f"the request's 'mode' must be delivery or service, not {mode!r:.80}")
        if suite is not None and not isinstance(suite, str):
            raise ValueError("the request's 'params_from_suite' must be a suite name or null")
        if "node" not in data:
            raise ValueError(
                'the request names no \'node\' ({"kind": "host"} or {"kind": "scenario", '
                '"path": "/abs/node.yaml"})'
            )
        node = NodeSpec.from_dict(data["node"])
        return cls(check, float(timeout_s), params, cast(Mode, mode), config, node, suite)


_KEYS = ("check", "timeout_s", "params", "mode", "config", "node", "params_from_suite")


def _kind_of(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _no_other_keys(what: str, data: Mapping[str, object], known: tuple[str, ...]) -> None:
    unknown = sorted(str(k)[:40] for k in data if k not in known)
    if unknown:
        raise ValueError(
            f"the {what} has unknown key(s) {', '.join(map(repr, unknown[:5]))}; "
            f"expected only {', '.join(known)}"
        )


# -- the caller's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ChildAnswer:
    """What came back: the check's results, or (``results`` None) why there are none."""

    results: list[Result] | None
    failure: str = ""


def call_child(spec: ChildSpec, grace_s: float = GRACE_S) -> ChildAnswer:
    """Run ``spec`` in a child Python, killed ``grace_s`` after the check's own timeout."""
    done = proc.run(
        proc.python_module_argv(CHILD_MODULE),
        timeout_s=spec.timeout_s + grace_s,
        cwd=proc.CHILD_CWD,
        input_text=spec.to_json(),
    )
    if not done.ok:
        return ChildAnswer(None, done.describe_failure())
    try:
        return ChildAnswer([Result.from_dict(r) for r in json.loads(done.stdout)["results"]])
    except (ValueError, KeyError, TypeError) as err:
        return ChildAnswer(None, f"unreadable results from the child process: {err}")


def run_in_child(spec: ChildSpec, grace_s: float = GRACE_S) -> list[Result]:
    """The daemon's call: the child's results, or one ``error`` result saying why there are
    none (it crashed, hung, refused the request or wrote something unreadable)."""
    answer = call_child(spec, grace_s)
    if answer.results is not None:
        return answer.results
    return [
        Result(
            check=spec.check,
            target="node",
            metric="ran",
            status=Status.ERROR,
            detail=f"check {spec.check} in a child process failed: {answer.failure}",
        )
    ]


# -- the child's side -----------------------------------------------------------------------------


def serve(run: Callable[[ChildSpec], list[Result]]) -> int:
    """The child's main: read one request from stdin, ``run`` it, write the results to stdout;
    the exit status (:data:`RAN`, :data:`REFUSED`, :data:`CRASHED`). ``run`` raises
    ConfigError for a configuration or node that does not validate (a refusal)."""
    # stdout carries the results alone: while the check runs, whatever it or a process it
    # starts prints goes to stderr (file descriptor 1 points there until the answer)
    answer = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    try:
        spec = ChildSpec.from_json(_read_request())
    except ValueError as err:
        return _refuse(err)
    try:
        results = run(spec)
    except ConfigError as err:
        return _refuse(err)
    except Exception:  # noqa: BLE001 - the caller reads the reason from stderr
        traceback.print_exc(limit=8)
        return CRASHED
    with answer:
        json.dump({"results": [r.to_dict() for r in results]}, answer)
    return RAN


def _refuse(err: Exception) -> int:
    print(f"check child: refused the request, nothing ran: {err}", file=sys.stderr)
    return REFUSED


def _read_request() -> str:
    data = sys.stdin.buffer.read(MAX_REQUEST_BYTES + 1)
    if len(data) > MAX_REQUEST_BYTES:
        raise ValueError(f"the request is larger than {MAX_REQUEST_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"the request is not UTF-8 ({err.reason} at byte {err.start})") from None
