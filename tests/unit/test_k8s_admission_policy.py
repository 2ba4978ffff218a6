"""packaging/kubernetes/admission-policy.yaml: the agent's service account may change only its own
node and delete only pods bound to it. The policy is evaluated with cel-python as the API server
would (tests/k8s_admission.py says how, and why no API server runs here).
"""

from __future__ import annotations

import copy

import pytest

pytest.importorskip("celpy", reason="cel-python is not installed: make deps-test")

from k8s_admission import BINDING, POLICY, admit, drained, node, pod, request  # noqa: E402


def test_the_policy_fails_closed_and_is_bound_to_deny() -> None:
    assert POLICY["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert POLICY["spec"]["failurePolicy"] == "Fail"
    assert BINDING["spec"]["policyName"] == POLICY["metadata"]["name"]
    assert BINDING["spec"]["validationActions"] == ["Deny"]


def test_cordon_and_taint_of_its_own_node_is_allowed() -> None:
    old = node()
    decision = admit(request("UPDATE", "nodes", "gpu-01"), drained(old), old)
    assert decision.matched and decision.allowed, decision.messages


def test_resume_of_its_own_node_is_allowed() -> None:
    old = drained(node())
    decision = admit(request("UPDATE", "nodes", "gpu-01"), node(), old)
    assert decision.allowed, decision.messages


def test_writing_its_own_condition_is_allowed() -> None:
    old = node()
    new = copy.deepcopy(old)
    new["status"]["conditions"].append(
        {"type": "GPUHealthy", "status": "False", "reason": "NodeAgentDrained"}
    )
    decision = admit(request("UPDATE", "nodes", "gpu-01", sub="status"), new, old)
    assert decision.allowed, decision.messages


def test_another_node_is_denied() -> None:
    old = node("gpu-02")
    decision = admit(request("UPDATE", "nodes", "gpu-02"), drained(old), old)
    assert decision.matched and not decision.allowed
    assert any("only its own node, not gpu-02" in m for m in decision.messages)


def test_dropping_a_taint_it_does_not_own_is_denied() -> None:
    old = node()
    new = drained(old)
    new["spec"]["taints"] = [t for t in new["spec"]["taints"] if t["key"] != "nvidia.com/gpu"]
    decision = admit(request("UPDATE", "nodes", "gpu-01"), new, old)
    assert not decision.allowed
    assert any("only its own taint" in m for m in decision.messages)


def test_adding_a_foreign_taint_is_denied() -> None:
    old = node()
    new = copy.deepcopy(old)
    new["spec"]["taints"].append({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"})
    assert not admit(request("UPDATE", "nodes", "gpu-01"), new, old).allowed


def test_changing_a_label_or_a_foreign_annotation_is_denied() -> None:
    old = node()
    relabelled = copy.deepcopy(old)
    relabelled["metadata"]["labels"]["nvidia.com/gpu.present"] = "false"
    assert not admit(request("UPDATE", "nodes", "gpu-01"), relabelled, old).allowed
    annotated = copy.deepcopy(old)
    annotated["metadata"]["annotations"]["node.alpha.kubernetes.io/ttl"] = "60"
    assert not admit(request("UPDATE", "nodes", "gpu-01"), annotated, old).allowed
    dropped = copy.deepcopy(old)
    del dropped["metadata"]["annotations"]["node.alpha.kubernetes.io/ttl"]
    assert not admit(request("UPDATE", "nodes", "gpu-01"), dropped, old).allowed


def test_removing_a_condition_it_does_not_own_is_denied() -> None:
    old = node()
    new = copy.deepcopy(old)
    new["status"]["conditions"] = [c for c in new["status"]["conditions"] if c["type"] != "Ready"]
    decision = admit(request("UPDATE", "nodes", "gpu-01", sub="status"), new, old)
    assert not decision.allowed
    assert any("own node condition" in m for m in decision.messages)


def test_deleting_a_pod_on_its_node_is_allowed() -> None:
    decision = admit(request("DELETE", "pods", "train-0", namespace="ml"), None, pod("gpu-01"))
    assert decision.matched and decision.allowed, decision.messages


def test_deleting_a_pod_on_another_node_or_unscheduled_is_denied() -> None:
    for where in ("gpu-02", None):
        decision = admit(request("DELETE", "pods", "train-0", namespace="ml"), None, pod(where))
        assert not decision.allowed, where
        assert any("only pods bound to its node" in m for m in decision.messages)


def test_a_token_without_a_node_name_is_denied() -> None:
    old = node()
    decision = admit(request("UPDATE", "nodes", "gpu-01", token_node=None), drained(old), old)
    assert not decision.allowed
    assert any("names no node" in m for m in decision.messages)


def test_a_request_from_another_service_account_is_not_matched() -> None:
    old = node("gpu-02")
    other = request("UPDATE", "nodes", "gpu-02", username="system:serviceaccount:kube-system:x")
    decision = admit(other, drained(old), old)
    assert not decision.matched and decision.allowed


def test_operations_outside_the_rules_are_not_matched() -> None:
    """Reads and pod creation are RBAC's business; the policy constrains only writes."""
    assert not admit(request("CREATE", "pods", "p", namespace="ml"), pod("gpu-02"), None).matched
