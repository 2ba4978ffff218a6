"""The kubernetes adapter, through the REAL official client, against a stand-in Node API.

No Kubernetes API server can run here (no container runtime, no etcd), so a small HTTP server on
127.0.0.1 plays the part of ``/api/v1/nodes`` (and ``/api/v1/namespaces/NS/pods/NAME`` for job
restarts: GET, and DELETE honouring a ``preconditions.uid``, 409 when it does not match, as the
API server does): it records every request the real client sends
(method, path, Content-Type, JSON body) and applies patches the way the API server does for
these fields (strategic merge: maps merge, ``null`` deletes a key, ``spec.taints`` is replaced
whole, ``status.conditions`` merge by ``type``; a stale ``metadata.resourceVersion`` is 409).
The assertions are on the exact requests, which is what a real API server would receive.
``FakeNodeApi.answers`` makes it answer one request as a misbehaving server or proxy would (a
redirect, a 200 whose body is not a Node or NodeList), which no real API server here can be made
to do.
"""

from __future__ import annotations

import copy
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

kubernetes = pytest.importorskip(
    "kubernetes", reason="kubernetes client not installed: pip install -e '.[k8s]' (make deps-test)"
)

from node_agent.config import config_from_dict  # noqa: E402
from node_agent.model import Action, ActionOutcome, Grade, Level, Reason  # noqa: E402
from node_agent.remediation.executor import Remediator  # noqa: E402
from node_agent.remediation.plan import Safety  # noqa: E402
from node_agent.remediation.store import open_store  # noqa: E402
from node_agent.schedulers import AdapterError, AdapterStatus  # noqa: E402
from node_agent.schedulers.kubernetes import (  # noqa: E402
    ANN_CORDONED,
    ANN_KEY,
    ANN_REASON,
    ANN_REBOOT,
    JOB_NOT_RUNNING,
    REBOOT_REQUESTED,
    KubernetesAdapter,
)

NOW = "2025-01-02T03:04:05Z"
SMP = "application/strategic-merge-patch+json"


def make_node(name: str, unschedulable: bool = False, taints=None) -> dict:
    return {
        "kind": "Node",
        "apiVersion": "v1",
        "metadata": {"name": name, "resourceVersion": "100", "annotations": {}},
        "spec": {"unschedulable": unschedulable, "taints": taints or []},
        "status": {"conditions": [{"type": "Ready", "status": "True"}]},
    }


def strategic_merge(target: dict, patch: dict, path: str = "") -> None:
    for key, value in patch.items():
        where = f"{path}.{key}"
        if value is None:
            target.pop(key, None)
        elif where == ".status.conditions":
            conds = target.setdefault(key, [])
            for new in value:
                conds[:] = [c for c in conds if c["type"] != new["type"]] + [new]
        elif isinstance(value, dict) and isinstance(target.get(key), dict):
            strategic_merge(target[key], value, where)
        else:
            target[key] = copy.deepcopy(value)


def make_pod(
    namespace: str,
    name: str,
    node: str | None,
    phase: str = "Running",
    controller: str | None = "Job",
    uid: str = "6f1c2d3e-4a5b-4c6d-8e7f-000000000001",
) -> dict:
    owners = (
        [
            {
                "apiVersion": "batch/v1",
                "kind": controller,
                "name": f"{name}-ctl",
                "uid": "owner-uid",
                "controller": True,
            }
        ]
        if controller
        else []
    )
    return {
        "kind": "Pod",
        "apiVersion": "v1",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "resourceVersion": "7",
            "ownerReferences": owners,
        },
        "spec": {"nodeName": node, "containers": [{"name": "trainer", "image": "t"}]},
        "status": {"phase": phase},
    }


class NodeApiHandler(BaseHTTPRequestHandler):
    """The stand-in API server's requests: it records each one and answers as the API server
    would for nodes (GET, strategic-merge PATCH) and pods (GET, DELETE with a uid precondition)."""

    @property
    def api(self) -> FakeNodeApi:
        return self.server.api  # type: ignore[attr-defined, no-any-return]

    def log_message(self, *args):
        pass

    def _send(self, code: int, body: dict, headers: dict[str, str] | None = None):
        data = json.dumps(body).encode()
        self.send_response(code)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _not_found(self, kind: str, name: str):
        return self._send(
            404, {"kind": "Status", "reason": "NotFound", "message": f'{kind} "{name}" not found'}
        )

    def _record(self, body=None):
        self.api.requests.append(
            {
                "method": self.command,
                "path": self.path.split("?")[0],
                "content_type": self.headers.get("Content-Type"),
                "body": body,
            }
        )

    def _canned(self) -> bool:
        """Answer from ``api.answers`` (a misbehaving server), if it holds this request."""
        answer = self.api.answers.get((self.command, self.path.split("?")[0]))
        if answer is not None:
            self._send(*answer)
        return answer is not None

    def do_GET(self):
        self._record()
        if self._canned():
            return None
        if self.api.fail_status:
            return self._send(self.api.fail_status, {"kind": "Status", "message": "boom"})
        parts = self.path.split("?")[0].strip("/").split("/")
        if parts[2:3] == ["namespaces"] and parts[4:5] == ["pods"]:
            pod = self.api.pods.get((parts[3], parts[5]))
            if pod is None:
                return self._not_found("pods", parts[5])
            return self._send(200, pod)
        if parts == ["api", "v1", "nodes"]:
            return self._send(
                200,
                {"kind": "NodeList", "apiVersion": "v1", "items": list(self.api.nodes.values())},
            )
        node = self.api.nodes.get(parts[-1])
        if node is None:
            return self._not_found("nodes", parts[-1])
        return self._send(200, node)

    def do_PATCH(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._record(body)
        if self._canned():
            return None
        parts = self.path.split("?")[0].strip("/").split("/")
        node = self.api.nodes[parts[3]]
        rv = (body.get("metadata") or {}).get("resourceVersion")
        if rv is not None and rv != node["metadata"]["resourceVersion"]:
            return self._send(
                409,
                {
                    "kind": "Status",
                    "reason": "Conflict",
                    "message": "the object has been modified",
                },
            )
        strategic_merge(node, body)
        node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)
        return self._send(200, node)

    def do_DELETE(self):
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        self._record(body)
        parts = self.path.split("?")[0].strip("/").split("/")
        pod = self.api.pods.get((parts[3], parts[5]))
        if pod is None:
            return self._not_found("pods", parts[5])
        uid = ((body or {}).get("preconditions") or {}).get("uid")
        if uid is not None and uid != pod["metadata"]["uid"]:
            return self._send(
                409,
                {
                    "kind": "Status",
                    "reason": "Conflict",
                    "message": "Precondition failed: UID in precondition"
                    f": {uid}, UID in object meta: "
                    f"{pod['metadata']['uid']}",
                },
            )
        del self.api.pods[(parts[3], parts[5])]
        return self._send(200, pod)


class FakeNodeApi:
    def __init__(self, nodes: dict[str, dict], pods: dict[tuple[str, str], dict] | None = None):
        self.nodes = nodes
        self.pods = pods if pods is not None else {}
        self.requests: list[dict] = []
        self.fail_status: int | None = None
        # (method, path) -> (status, body, headers): that request answered so, whatever it asks
        self.answers: dict[tuple[str, str], tuple[int, dict, dict[str, str]]] = {}
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), NodeApiHandler)
        self.server.api = self  # type: ignore[attr-defined]
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def patches(self) -> list[dict]:
        return [r for r in self.requests if r["method"] == "PATCH"]


@pytest.fixture
def api():
    U9 = "6f1c2d3e-4a5b-4c6d-8e7f-000000000009"
    fake = FakeNodeApi(
        {
            "gpu-01": make_node("gpu-01"),
            "gpu-02": make_node("gpu-02"),
            "gpu-03": make_node("gpu-03", unschedulable=True),
        },
        {
            ("ml", "trainer-0"): make_pod("ml", "trainer-0", "gpu-01"),
            ("ml", "trainer-1"): make_pod("ml", "trainer-1", "gpu-02"),
            ("default", "solo"): make_pod("default", "solo", "gpu-01", controller=None),
            ("default", "trainer-9"): make_pod("default", "trainer-9", "gpu-01", uid=U9),
            ("ml", "done-0"): make_pod("ml", "done-0", "gpu-01", phase="Succeeded"),
        },
    )
    yield fake
    fake.close()


def adapter_for(
    api: FakeNodeApi, pod_namespace: str = "default", own_node: str = "gpu-01"
) -> KubernetesAdapter:
    from kubernetes import client

    configuration = client.Configuration()
    configuration.host = api.url
    return KubernetesAdapter(
        client.ApiClient(configuration),
        taint_key="node-agent/health",
        timeout_s=5,
        clock=lambda: NOW,
        pod_namespace=pod_namespace,
        own_node=own_node,
    )


def test_drain_cordons_taints_and_sets_condition_false_with_exact_requests(api):
    outcome = adapter_for(api).drain("gpu-01", "node-agent: FAULT xid79 gpu:5")
    assert outcome.status is AdapterStatus.DONE and "gpu-01" in outcome.detail
    get, spec_patch, status_patch = api.requests
    assert (get["method"], get["path"]) == ("GET", "/api/v1/nodes/gpu-01")
    assert spec_patch["path"] == "/api/v1/nodes/gpu-01"
    assert spec_patch["content_type"] == SMP
    assert spec_patch["body"] == {
        "metadata": {
            "resourceVersion": "100",
            "annotations": {ANN_REASON: "node-agent: FAULT xid79 gpu:5", ANN_CORDONED: "true"},
        },
        "spec": {
            "unschedulable": True,
            "taints": [{"key": "node-agent/health", "value": "FAULT", "effect": "NoSchedule"}],
        },
    }
    assert status_patch["path"] == "/api/v1/nodes/gpu-01/status"
    assert status_patch["content_type"] == SMP
    assert status_patch["body"] == {
        "status": {
            "conditions": [
                {
                    "type": "GPUHealthy",
                    "status": "False",
                    "reason": "NodeAgentDrained",
                    "message": "node-agent: FAULT xid79 gpu:5",
                    "lastHeartbeatTime": NOW,
                    "lastTransitionTime": NOW,
                }
            ]
        }
    }
    state = adapter_for(api).node_state("gpu-01")
    assert state.drained and state.drained_by_agent
    assert state.state == "Ready,SchedulingDisabled"


def test_drain_keeps_other_taints(api):
    api.nodes["gpu-01"]["spec"]["taints"] = [{"key": "nvidia.com/gpu", "effect": "NoSchedule"}]
    adapter_for(api).drain("gpu-01", "ERROR xid48 gpu:3")
    taints = api.patches()[0]["body"]["spec"]["taints"]
    assert taints == [
        {"key": "nvidia.com/gpu", "effect": "NoSchedule"},
        {"key": "node-agent/health", "value": "ERROR", "effect": "NoSchedule"},
    ]


def test_resume_removes_taint_uncordons_and_sets_condition_true(api):
    adapter = adapter_for(api)
    adapter.drain("gpu-01", "ERROR xid48 gpu:3")
    api.requests.clear()
    adapter.resume("gpu-01", "re-test passed")
    spec_patch, status_patch = api.patches()
    assert spec_patch["content_type"] == SMP
    assert spec_patch["body"] == {
        "metadata": {
            "resourceVersion": "102",
            "annotations": {
                ANN_REASON: None,
                ANN_CORDONED: None,
                ANN_REBOOT: None,
                ANN_KEY: None,
            },
        },
        "spec": {"taints": [], "unschedulable": False},
    }
    cond = status_patch["body"]["status"]["conditions"][0]
    assert (cond["type"], cond["status"], cond["reason"]) == (
        "GPUHealthy",
        "True",
        "NodeAgentHealthy",
    )
    node = api.nodes["gpu-01"]
    assert node["spec"] == {"unschedulable": False, "taints": []}
    assert not adapter.node_state("gpu-01").drained


def test_resume_of_a_node_the_agent_only_tainted_leaves_it_cordoned(api):
    """Cordoned by the agent's own earlier drain without the cordoned mark (e.g. an older
    agent): the taint goes, the cordon stays for a person to lift."""
    api.nodes["gpu-01"]["spec"] = {
        "unschedulable": True,
        "taints": [{"key": "node-agent/health", "value": "ERROR", "effect": "NoSchedule"}],
    }
    detail = adapter_for(api).resume("gpu-01", "re-test passed").detail
    assert "left cordoned" in detail
    assert "unschedulable" not in api.patches()[0]["body"]["spec"]
    assert api.nodes["gpu-01"]["spec"]["unschedulable"] is True


def test_restart_requests_reboot_by_annotation(api):
    outcome = adapter_for(api).restart("gpu-01", "ERROR row_remap_pending gpu:2")
    assert outcome.status is AdapterStatus.DONE and outcome.detail.startswith(REBOOT_REQUESTED)
    spec_patch, status_patch = api.patches()
    assert spec_patch["body"]["metadata"]["annotations"][ANN_REBOOT] == NOW
    assert status_patch["body"]["status"]["conditions"][0]["reason"] == "NodeAgentRebootRequested"


def test_replace_uses_replace_reason_and_condition(api):
    adapter_for(api).replace("gpu-01", "FAULT row_remap_failure gpu:2")
    spec_patch, status_patch = api.patches()
    assert spec_patch["body"]["metadata"]["annotations"][ANN_REASON].startswith(
        "node-agent: replace: FAULT"
    )
    assert status_patch["body"]["status"]["conditions"][0]["reason"] == "NodeAgentReplace"


def test_list_nodes_reads_every_node(api):
    adapter = adapter_for(api, own_node="gpu-02")
    adapter.drain("gpu-02", "FAULT xid79 gpu:1")
    nodes = {n.name: n for n in adapter.list_nodes()}
    assert set(nodes) == {"gpu-01", "gpu-02", "gpu-03"}
    assert nodes["gpu-02"].drained_by_agent
    assert nodes["gpu-03"].drained and not nodes["gpu-03"].drained_by_agent
    assert ("GET", "/api/v1/nodes") in [(r["method"], r["path"]) for r in api.requests]


def test_unknown_node_is_adapter_error_with_the_api_body(api):
    with pytest.raises(AdapterError, match=r'404.*nodes \\"nope\\" not found|404.*not found'):
        adapter_for(api, own_node="nope").drain("nope", "FAULT")


def test_conflicting_update_is_adapter_error_not_a_lost_taint(api):
    adapter = adapter_for(api)
    original = adapter._get

    def stale_get(node):
        obj = original(node)
        api.nodes[node]["metadata"]["resourceVersion"] = "999"  # someone else wrote meanwhile
        return obj

    adapter._get = stale_get
    with pytest.raises(AdapterError, match="409"):
        adapter.drain("gpu-01", "FAULT xid79 gpu:5")


class _FaultReport:
    """The fields of a Report the remediator reads."""

    def __init__(self, grade: Grade):
        self.grade, self.suite, self.mode = grade, "quick", "service"

    def to_dict(self) -> dict:
        return {"grade": self.grade.to_dict()}


def test_a_patch_answered_with_a_redirect_is_failed_not_followed(api, tmp_path):
    """A 303 to the PATCH would make urllib3 GET the node, whose 200 read as a drain done: the
    client follows no redirect, the step is ``failed`` in the journal (the next run retries it)
    and the node is untouched."""
    node = "/api/v1/nodes/gpu-01"
    api.answers[("PATCH", node)] = (303, {}, {"Location": node})
    store, warnings = open_store(tmp_path / "state"), []
    try:
        out = Remediator(
            store, adapter_for(api), "gpu-01", Safety(), state_dir=None, warn=warnings.append
        ).act("drain", "node-agent: FAULT xid79 gpu:5")
        (record,) = out.records
        assert record.outcome is ActionOutcome.FAILED and out.wants_retry
        assert "HTTP 303" in record.detail and "redirects are not followed" in record.detail
        (row,) = store.journal_tail("gpu-01")
        assert (row.action, row.state) == ("drain", "failed")
        assert any("kept in the journal" in w for w in warnings)
    finally:
        store.close()
    sent = [(r["method"], r["path"]) for r in api.requests]
    assert sent[-1] == ("PATCH", node) and sent.count(("PATCH", node)) == 1  # no GET after it
    assert api.nodes["gpu-01"]["spec"] == {"unschedulable": False, "taints": []}


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": 500},
        make_node("gpu-02"),
        {"kind": "Node", "metadata": {"name": "gpu-01"}},
    ],
    ids=["empty", "status", "another-node", "no-spec"],
)
def test_a_node_answer_that_is_not_this_node_is_an_error_not_in_service(api, answer):
    """The agent's own drain is on the node; a GET answered 200 with something that is not that
    Node must not read as "already in service" (which would close the drain's episode)."""
    api.nodes["gpu-01"] = make_node(
        "gpu-01",
        unschedulable=True,
        taints=[{"key": "node-agent/health", "value": "FAULT", "effect": "NoSchedule"}],
    )
    api.answers[("GET", "/api/v1/nodes/gpu-01")] = (200, answer, {})
    adapter = adapter_for(api)
    with pytest.raises(AdapterError, match=r"GET node gpu-01: the answer is not a Node gpu-01"):
        adapter.resume("gpu-01", "re-test passed")
    with pytest.raises(AdapterError, match="not a Node gpu-01"):
        adapter.node_state("gpu-01")
    assert api.patches() == []


STATUS = {
    "kind": "Status",
    "apiVersion": "v1",
    "status": "Failure",
    "message": "etcdserver: timeout",
}


@pytest.mark.parametrize(
    "answer",
    [{}, {"metadata": {"name": "gpu-01"}, "spec": {"unschedulable": False}}],
    ids=["empty", "not-cordoned"],
)
def test_a_patch_whose_answer_does_not_show_the_cordon_is_not_a_drain(api, answer):
    """A 200 is not enough: the answer must be the node, cordoned with the agent's taint (a
    proxy's or a broken server's 200 would otherwise record a drain that did not happen)."""
    api.answers[("PATCH", "/api/v1/nodes/gpu-01")] = (200, answer, {})
    with pytest.raises(AdapterError, match="PATCH node gpu-01"):
        adapter_for(api).drain("gpu-01", "node-agent: FAULT xid79 gpu:5")


@pytest.mark.parametrize(
    "answer",
    [STATUS, {"kind": "NodeList", "apiVersion": "v1"}, {"kind": "NodeList", "items": [{}]}],
    ids=["status", "no-items", "item-not-a-node"],
)
def test_a_node_list_that_is_not_a_node_list_is_an_error_not_an_empty_cluster(api, answer):
    api.answers[("GET", "/api/v1/nodes")] = (200, answer, {})
    with pytest.raises(AdapterError, match="LIST nodes: the answer is not a Node"):
        adapter_for(api).list_nodes()


def test_an_unreadable_node_list_refuses_the_automatic_drain(api, tmp_path):
    """The blast-radius guard reads the drained share from the node list: a LIST answered with a
    Status is not an empty cluster (nobody drained, drain away) but a refusal."""
    api.answers[("GET", "/api/v1/nodes")] = (200, STATUS, {})
    store = open_store(tmp_path / "state")
    try:
        reason = Reason("xid", Level.FAULT, "gpu:5", "Xid 64", catalog="xid", code=64)
        out = Remediator(store, adapter_for(api), "gpu-01", Safety(), state_dir=None).remediate(
            _FaultReport(Grade(Level.FAULT, Action.DRAIN, (reason,)))
        )
    finally:
        store.close()
    assert [r.outcome for r in out.records] == [ActionOutcome.REFUSED]
    assert "not a NodeList" in out.records[0].detail, out.records[0].detail
    assert api.patches() == []


def test_open_adapter_with_missing_kubeconfig_says_what_to_set(tmp_path, monkeypatch):
    from node_agent.schedulers import open_adapter

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    config = config_from_dict(
        {
            "adapter": {
                "name": "kubernetes",
                "kubernetes": {"kubeconfig": str(tmp_path / "missing-kubeconfig")},
            }
        }
    )
    with pytest.raises(AdapterError, match="adapter.kubernetes.kubeconfig"):
        open_adapter(config)


# -- restart_job: delete the hung pod on this node, its controller recreates it ---------------
HANG = "node-agent: ERROR training-hang job pod:ml/trainer-0 rank:0 made no step for 412 s"
U1 = "6f1c2d3e-4a5b-4c6d-8e7f-000000000001"  # the pod UID the kernel's kubepods cgroup gives (training.processes.read_pod_uid)


def test_restart_job_deletes_the_pod_on_this_node_with_a_uid_precondition(api):
    detail = adapter_for(api).restart_job("gpu-01", f"pod:ml/trainer-0@{U1}", HANG).detail
    assert detail.startswith("kubernetes: deleted pod ml/trainer-0 on gpu-01"), detail
    assert "Job/trainer-0-ctl" in detail
    get, delete = api.requests
    assert (get["method"], get["path"]) == ("GET", "/api/v1/namespaces/ml/pods/trainer-0")
    assert (delete["method"], delete["path"]) == ("DELETE", "/api/v1/namespaces/ml/pods/trainer-0")
    assert delete["body"]["preconditions"] == {"uid": U1}
    assert ("ml", "trainer-0") not in api.pods
    assert api.patches() == []  # the node is not touched


def test_restart_job_of_a_pod_without_namespace_uses_the_configured_one(api):
    adapter_for(api).restart_job("gpu-01", f"pod:trainer-9@{U1[:-1]}9", HANG)
    assert api.requests[-1]["path"] == "/api/v1/namespaces/default/pods/trainer-9"
    assert ("default", "trainer-9") not in api.pods
    with pytest.raises(AdapterError, match="404.*pod_namespace"):
        adapter_for(api, pod_namespace="team-a").restart_job("gpu-01", f"pod:trainer-1@{U1}", HANG)


def test_restart_job_refuses_a_pod_on_another_node(api):
    with pytest.raises(
        AdapterError,
        match="restarts only pods running on gpu-01; job "
        "pod:ml/trainer-1@.* is pod ml/trainer-1 on gpu-02",
    ):
        adapter_for(api).restart_job("gpu-01", f"pod:ml/trainer-1@{U1}", HANG)
    assert [r["method"] for r in api.requests] == ["GET"]
    assert ("ml", "trainer-1") in api.pods


def test_restart_job_refuses_a_bare_pod_that_nothing_would_recreate(api):
    with pytest.raises(AdapterError, match="no controller"):
        adapter_for(api).restart_job("gpu-01", f"pod:default/solo@{U1}", HANG)
    assert ("default", "solo") in api.pods


def test_restart_job_leaves_a_pod_that_is_not_running_alone(api):
    outcome = adapter_for(api).restart_job("gpu-01", f"pod:ml/done-0@{U1}", HANG)
    assert outcome.status is AdapterStatus.ALREADY
    assert outcome.detail.startswith(JOB_NOT_RUNNING) and "Succeeded" in outcome.detail
    assert ("ml", "done-0") in api.pods


def test_restart_job_of_a_pod_replaced_meanwhile_is_a_conflict_not_a_second_delete(api):
    adapter = adapter_for(api)
    original = adapter._call

    def replaced_after_get(what, fn, *args, **kwargs):
        out = original(what, fn, *args, **kwargs)
        if what.startswith("GET pod"):
            api.pods[("ml", "trainer-0")]["metadata"]["uid"] = U1[:-1] + "2"  # recreated
        return out

    adapter._call = replaced_after_get
    with pytest.raises(AdapterError, match="409.*replaced meanwhile"):
        adapter.restart_job("gpu-01", f"pod:ml/trainer-0@{U1}", HANG)
    assert ("ml", "trainer-0") in api.pods


@pytest.mark.parametrize(
    "job",
    [
        "slurm:1234",
        "pod:ML/Trainer",
        "pod:a/b/c",
        "pod:-x",
        "pod:x;reboot",
        "pod:" + "a" * 260,
        "pod:../etc",
        "pod:ml/trainer-0",
        "pod:ml/trainer-0@uid-1",
    ],
)
def test_restart_job_refuses_other_or_invalid_job_ids_before_any_request(api, job):
    with pytest.raises(AdapterError, match="job id|restarts only pods running on gpu-01"):
        adapter_for(api).restart_job("gpu-01", job, HANG)
    assert api.requests == []


def test_restart_job_refuses_a_pod_whose_uid_is_not_the_one_the_kernel_names(api):
    """A training process's environment said KUBERNETES_POD_NAME=ml/trainer-0, but its kubepods
    cgroup names another pod: the name is someone else's pod, never deleted."""
    other = U1[:-1] + "7"
    with pytest.raises(AdapterError, match="refusing to delete pod ml/trainer-0: its uid is"):
        adapter_for(api).restart_job("gpu-01", f"pod:ml/trainer-0@{other}", HANG)
    assert [r["method"] for r in api.requests] == ["GET"]
    assert ("ml", "trainer-0") in api.pods


@pytest.mark.parametrize("action", ["drain", "replace", "restart", "resume"])
def test_an_action_on_another_node_is_refused_before_any_request(api, action):
    """The second guard behind the admission policy: an agent touches only its own node."""
    adapter = adapter_for(api, own_node="gpu-01")
    with pytest.raises(AdapterError, match="acts only on its own node gpu-01"):
        getattr(adapter, action)("gpu-02", "node-agent: FAULT xid79 gpu:1")
    assert api.requests == []


def test_restart_job_on_another_node_is_refused_before_any_request(api):
    with pytest.raises(AdapterError, match="acts only on its own node gpu-01"):
        adapter_for(api, own_node="gpu-01").restart_job("gpu-02", f"pod:ml/trainer-0@{U1}", HANG)
    assert api.requests == []


def test_own_node_is_node_name_then_the_downward_api_then_the_hostname():
    from node_agent.schedulers.kubernetes import own_node_name

    assert (
        own_node_name(
            config_from_dict({"node": {"name": "gpu-07"}}), {"NODE_AGENT_NODE_NAME": "gpu-09"}
        )
        == "gpu-07"
    )
    assert own_node_name(config_from_dict({}), {"NODE_AGENT_NODE_NAME": "gpu-09"}) == "gpu-09"
    import socket

    assert own_node_name(config_from_dict({}), {}) == socket.gethostname().split(".")[0]


@pytest.mark.parametrize("action", ["drain", "replace", "restart"])
def test_the_adapters_own_writes_pass_the_admission_policy(api, action):
    """Each write the adapter really sends (applied by the stand-in API as the API server applies
    it) is allowed by packaging/kubernetes/admission-policy.yaml, and so is the resume after it:
    the policy confines the agent without breaking it (CEL evaluated by tests/k8s_admission.py)."""
    pytest.importorskip("celpy", reason="cel-python is not installed: make deps-test")
    from k8s_admission import admit, request

    for act, reason in ((action, "node-agent: FAULT xid79 gpu:5"), ("resume", "re-test passed")):
        before = copy.deepcopy(api.nodes["gpu-01"])
        getattr(adapter_for(api), act)("gpu-01", reason)
        after = copy.deepcopy(api.nodes["gpu-01"])
        spec_written = copy.deepcopy(after)
        spec_written["status"] = copy.deepcopy(before["status"])
        assert spec_written != before, act
        for req, new, old in (
            (request("UPDATE", "nodes", "gpu-01"), spec_written, before),
            (request("UPDATE", "nodes", "gpu-01", sub="status"), after, spec_written),
        ):
            decision = admit(req, new, old)
            assert decision.matched and decision.allowed, (act, decision.messages)
