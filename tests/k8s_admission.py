"""Evaluate packaging/kubernetes/admission-policy.yaml as the API server would, with cel-python.

No Kubernetes API server can run here, so the policy's CEL is evaluated by ``cel-python`` (a pure
Python implementation of Google's Common Expression Language) the way the API server evaluates a
ValidatingAdmissionPolicy: the request must match ``matchConstraints`` (operation and resource)
and every ``matchCondition``; then ``variables`` are evaluated in order, each seeing the ones
before it as ``variables.<name>``; then each validation must be true, and one that cannot be
evaluated denies (``failurePolicy: Fail``). Admission requests are shaped as the API server sends
them: ``request.operation``, ``request.resource``/``subResource``, ``request.userInfo`` with
``username`` and ``extra``, ``object`` and ``oldObject`` (``object`` null on DELETE). The policy
keeps to standard CEL and its macros so that this library and the API server agree.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import celpy
import yaml

POLICY_FILE = (
    Path(__file__).resolve().parents[1] / "packaging" / "kubernetes" / "admission-policy.yaml"
)
AGENT = "system:serviceaccount:node-agent:node-agent"
NODE_KEY = "authentication.kubernetes.io/node-name"


def _documents() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(POLICY_FILE.read_text()) if d}


POLICY = _documents()["ValidatingAdmissionPolicy"]
BINDING = _documents()["ValidatingAdmissionPolicyBinding"]
_ENV = celpy.Environment()


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    program = _ENV.program(_ENV.compile(expression))
    return program.evaluate(activation)


class Decision:
    def __init__(self, matched: bool, allowed: bool, messages: list[str]) -> None:
        self.matched, self.allowed, self.messages = matched, allowed, messages


def admit(
    request: dict[str, Any], obj: dict[str, Any] | None, old: dict[str, Any] | None
) -> Decision:
    """What the API server decides for this request under the policy and its binding."""
    spec = POLICY["spec"]
    resource = request["resource"]["resource"] + (
        "/" + request["subResource"] if request.get("subResource") else ""
    )
    if not any(
        request["operation"] in rule["operations"] and resource in rule["resources"]
        for rule in spec["matchConstraints"]["resourceRules"]
    ):
        return Decision(False, True, [])
    base = {"request": request, "object": obj, "oldObject": old}
    activation = celpy.json_to_cel(base)
    for cond in spec.get("matchConditions", []):
        if not bool(_eval(cond["expression"], activation)):
            return Decision(False, True, [])
    variables: dict[str, Any] = {}
    for var in spec.get("variables", []):
        activation = celpy.json_to_cel(base)
        activation["variables"] = celpy.celtypes.MapType(variables)
        try:
            variables[celpy.celtypes.StringType(var["name"])] = _eval(var["expression"], activation)
        except celpy.CELEvalError as err:  # failurePolicy: Fail
            return Decision(True, False, [f"variable {var['name']}: {err}"])
    activation = celpy.json_to_cel(base)
    activation["variables"] = celpy.celtypes.MapType(variables)
    denied: list[str] = []
    for rule in spec["validations"]:
        try:
            ok = _eval(rule["expression"], activation)
        except celpy.CELEvalError as err:
            denied.append(f"could not evaluate ({err})")
            continue
        if not isinstance(ok, celpy.celtypes.BoolType):
            denied.append(f"not a boolean: {ok!r}")
        elif not ok:
            message = rule.get("message")
            if "messageExpression" in rule:
                message = str(_eval(rule["messageExpression"], activation))
            denied.append(message or rule["expression"])
    return Decision(True, not denied, denied)


def request(
    operation: str,
    resource: str,
    name: str,
    *,
    sub: str = "",
    username: str = AGENT,
    token_node: str | None = "gpu-01",
    namespace: str = "",
) -> dict[str, Any]:
    extra: dict[str, list[str]] = {"authentication.kubernetes.io/pod-name": ["node-agent-x7k2p"]}
    if token_node is not None:
        extra[NODE_KEY] = [token_node]
    kind = {"nodes": "Node", "pods": "Pod"}[resource]
    return {
        "uid": "705ab4f5-6393-11e8-b7cc-42010a800002",
        "kind": {"group": "", "version": "v1", "kind": kind},
        "resource": {"group": "", "version": "v1", "resource": resource},
        "subResource": sub,
        "requestKind": {"group": "", "version": "v1", "kind": kind},
        "name": name,
        "namespace": namespace,
        "operation": operation,
        "userInfo": {
            "username": username,
            "uid": "b5f1c1a0",
            "groups": ["system:serviceaccounts", "system:authenticated"],
            "extra": extra,
        },
        "dryRun": False,
    }


def node(name: str = "gpu-01") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "resourceVersion": "41",
            "labels": {"kubernetes.io/hostname": name, "nvidia.com/gpu.present": "true"},
            "annotations": {"node.alpha.kubernetes.io/ttl": "0"},
        },
        "spec": {
            "podCIDR": "10.244.1.0/24",
            "taints": [{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
        },
        "status": {
            "conditions": [
                {"type": "Ready", "status": "True", "reason": "KubeletReady"},
                {
                    "type": "MemoryPressure",
                    "status": "False",
                    "reason": "KubeletHasSufficientMemory",
                },
            ]
        },
    }


def drained(n: dict[str, Any]) -> dict[str, Any]:
    """The node after the adapter's drain patch: cordoned, its taint, its annotations."""
    after = copy.deepcopy(n)
    after["spec"]["unschedulable"] = True
    after["spec"]["taints"].append(
        {"key": "node-agent/health", "value": "FAULT", "effect": "NoSchedule"}
    )
    after["metadata"]["annotations"].update(
        {"node-agent/reason": "node-agent: FAULT ...", "node-agent/cordoned": "true"}
    )
    return after


def pod(node_name: str | None) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": [{"name": "trainer", "image": "trainer:1"}]}
    if node_name is not None:
        spec["nodeName"] = node_name
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "train-0", "namespace": "ml", "uid": "0d3a5c4e"},
        "spec": spec,
    }
