"""The ``kubernetes`` adapter: cordon, a NoSchedule taint and a ``GPUHealthy`` node condition.

Through the official ``kubernetes`` client (``pip install node-agent[k8s]``), in-cluster config
when running in a pod, else ``adapter.kubernetes.kubeconfig`` (or the default kubeconfig).

drain(node, reason)::

    GET   /api/v1/nodes/N
    PATCH /api/v1/nodes/N          (strategic merge) spec.unschedulable=true, spec.taints += the
          agent's taint {key: adapter.kubernetes.taint_key, value: <grade>, effect: NoSchedule},
          annotations node-agent/reason (the full reason) and node-agent/cordoned ("true" only
          when the agent itself turned unschedulable on), metadata.resourceVersion (so a
          concurrent change makes the API answer 409 instead of losing a taint)
    PATCH /api/v1/nodes/N/status   (strategic merge, conditions merge by type)
          {type: GPUHealthy, status: "False", reason: NodeAgentDrained, message: <reason>}

resume removes the agent's taint and annotations, uncordons only when the agent cordoned, and
sets ``GPUHealthy=True``; it refuses (AdapterError) a node that is cordoned without the agent's
taint, i.e. cordoned by someone else. restart cannot reboot (Kubernetes has no reboot API): it
drains and sets the annotation ``node-agent/reboot-requested`` and condition reason
``NodeAgentRebootRequested`` for a reboot operator to act on; the detail starts with
``reboot-requested:``. replace drains with a ``node-agent: replace:`` reason and condition reason
``NodeAgentReplace``.

restart_job(node, job, reason) restarts a hung training pod by deleting it, so that its controller
(Job, JobSet, PyTorchJob, StatefulSet...) creates it again::

    GET    /api/v1/namespaces/NS/pods/NAME
    DELETE /api/v1/namespaces/NS/pods/NAME   {preconditions: {uid: <UID>}}

only for ``pod:<namespace>/<name>@<UID>`` or ``pod:<name>@<UID>`` (namespace
``adapter.kubernetes.pod_namespace``), names that are DNS-1123 (a label for the namespace, a
subdomain for the name). The name comes from the hung process's environment, which its user
sets; the UID comes from the kernel (the kubepods cgroup holding the process,
``training.processes.read_pod_uid``). The pod is deleted only when the API's pod of that name
has that UID (else the environment named someone else's pod, and nothing is deleted), its
``spec.nodeName`` is this node and it has a controller (a bare pod would be gone for good, not
restarted). The UID precondition makes the API refuse (409) if the pod was replaced meanwhile
by one of the same name. A pod already being deleted, or not Running, is left alone (detail
``job-not-running:``).

The client never follows a redirect: a 3xx is a failed call (a 303 would turn a PATCH into a GET
whose 200 reads as done). A node that is not a Node of that ``metadata.name`` with a ``spec``, or a
node list that is not a ``NodeList`` with ``items``, is an AdapterError, never a node in service
or an empty cluster.

The adapter acts only on its own node (``own_node``: ``node.name``, else the DaemonSet's
``NODE_AGENT_NODE_NAME`` from the downward API, else the short hostname): a drain, resume,
restart or replace of another node, or a restart of a pod bound elsewhere, is refused before
any request.
It reads other nodes (the blast-radius share needs ``list``).

RBAC: get/list/patch on nodes, patch on nodes/status, get/delete on pods
(packaging/kubernetes/rbac.yaml). RBAC cannot confine those to one node; the
ValidatingAdmissionPolicy in packaging/kubernetes/admission-policy.yaml does, in the API server
(Kubernetes 1.30 and later), so this adapter's own refusal is the second guard, not the only one.
"""

from __future__ import annotations

import functools
import json
import re
import socket
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from node_agent.extras import install_command
from node_agent.model import utc_iso
from node_agent.schedulers.base import (
    AdapterError,
    AdapterOutcome,
    AdapterStatus,
    JobKind,
    NodeState,
    check_job_id,
    check_node_name,
    is_agent_reason,
    sanitise_reason,
)

if TYPE_CHECKING:
    from node_agent.config import Config

CONDITION_TYPE = "GPUHealthy"
ANN_REASON = "node-agent/reason"
ANN_CORDONED = "node-agent/cordoned"
ANN_REBOOT = "node-agent/reboot-requested"
ANN_KEY = "node-agent/idempotency-key"  # the action's key (remediation/executor.py), when given
REBOOT_REQUESTED = "reboot-requested:"
LEFT_AS_IS = "left-as-is:"
JOB_NOT_RUNNING = "job-not-running:"  # detail prefix: restart_job found nothing to delete
_GRADE_RE = re.compile(r"\b(HEALTHY|WARN|ERROR|FAULT)\b")
# DNS-1123 label (namespace, at most 63) and subdomain (pod name, at most 253): Kubernetes
# "Object Names and IDs".
_DNS_LABEL = r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?"
_DNS_SUBDOMAIN = rf"{_DNS_LABEL}(?:\.{_DNS_LABEL})*"
# a pod UID as the API server writes it (RFC 4122, lower-case)
_POD_UID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
#: the jobs restart_job accepts: the pod's name and, after '@', its UID from the kernel
POD_JOB = JobKind(
    "pod",
    re.compile(rf"(?:{_DNS_LABEL}/)?{_DNS_SUBDOMAIN}@{_POD_UID}"),
    "pod:<name>@<uid> or pod:<namespace>/<name>@<uid>, lower-case DNS-1123 "
    "names and the pod UID from the process's kubepods cgroup",
)


def taint_value(reason: str) -> str:
    """The taint value: the grade named in the reason (a label value: at most 63 characters of
    ``[A-Za-z0-9._-]``)."""
    match = _GRADE_RE.search(reason)
    return match.group(1) if match else "unhealthy"


def own_node_name(config: Config, environ: dict[str, str] | None = None) -> str:
    """The Kubernetes node this agent runs on: ``node.name``, else ``NODE_AGENT_NODE_NAME`` (the
    DaemonSet sets it from ``spec.nodeName``), else the short hostname."""
    from node_agent.config import configured_node_name

    return configured_node_name(config, environ) or socket.gethostname().split(".")[0]


def _load_api_client(kubeconfig: str | None) -> Any:
    try:
        from kubernetes import client
        from kubernetes import config as _config
    except ImportError as err:
        raise AdapterError(
            f"the kubernetes adapter needs the official client: {install_command('k8s')}"
        ) from err
    import os

    config: Any = _config  # the client's loaders carry no type annotations
    try:
        if kubeconfig is None and os.environ.get("KUBERNETES_SERVICE_HOST"):
            config.load_incluster_config()
            return client.ApiClient()
        return config.new_client_from_config(config_file=kubeconfig)
    except Exception as err:  # the loaders raise ConfigException, OSError, YAML errors
        raise AdapterError(
            f"cannot load Kubernetes credentials ({err}); run in a pod with the "
            "node-agent ServiceAccount or set adapter.kubernetes.kubeconfig"
        ) from err


def _no_redirects(api_client: Any) -> Any:
    """``api_client``, its HTTP pool set never to follow a redirect: a 3xx is an ApiException.

    urllib3 follows redirects by default, and a 303 turns a PATCH into a GET of the node whose
    200 would read as done. ``Configuration.retries`` cannot say so for every supported client:
    it reaches only the connection pools, and urllib3 1.x's PoolManager, which follows the
    redirects, ignores it; ``redirect=False`` on the pool manager's ``urlopen`` holds on 1.x and
    2.x."""
    pool = api_client.rest_client.pool_manager
    pool.urlopen = functools.partial(pool.urlopen, redirect=False)
    return api_client


def _node(obj: Any, what: str, name: str | None = None) -> dict[str, Any]:
    """``obj``, checked to be a Node the adapter can read: a ``metadata.name`` (``name`` when
    given) and a ``spec``. Anything else (``{}``, a ``Status``) is an AdapterError, never a node
    in service."""
    meta = obj.get("metadata") if isinstance(obj, dict) else None
    found = meta.get("name") if isinstance(meta, dict) else None
    named = isinstance(found, str) and found != "" and found == (name or found)
    if not named or not isinstance(obj.get("spec"), dict):
        raise AdapterError(
            f"Kubernetes API {what}: the answer is not a Node{f' {name}' if name else ''} "
            f"(metadata.name and spec): {str(obj)[:200]}; check what answers at the API "
            "server's address"
        )
    node: dict[str, Any] = obj
    return node


class KubernetesAdapter:
    name = "kubernetes"

    def __init__(
        self,
        api_client: Any,
        taint_key: str = "node-agent/health",
        timeout_s: float = 10,
        clock: Callable[[], str] = utc_iso,
        pod_namespace: str = "default",
        *,
        own_node: str,
    ) -> None:
        from kubernetes import client

        self.api = client.CoreV1Api(_no_redirects(api_client))
        self.own_node = check_node_name(own_node)
        self.taint_key = taint_key
        self.pod_namespace = pod_namespace
        self.timeout_s = timeout_s
        self._clock = clock

    @classmethod
    def from_config(cls, config: Config) -> KubernetesAdapter:
        return cls(
            _load_api_client(config.adapter.kubernetes.kubeconfig),
            taint_key=config.adapter.kubernetes.taint_key,
            pod_namespace=config.adapter.kubernetes.pod_namespace,
            own_node=own_node_name(config),
        )

    # -- plumbing ----------------------------------------------------------------------------

    def _call(
        self,
        what: str,
        fn: Callable[..., Any],
        *args: Any,
        hints: dict[int, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """Call the client raw (no model round trip) and return the decoded JSON body.

        ``hints`` replaces the operator hint for an HTTP status (the defaults are about nodes).
        """
        from kubernetes.client.exceptions import ApiException

        try:
            resp = fn(*args, _preload_content=False, _request_timeout=self.timeout_s, **kwargs)
            data = resp.data
        except ApiException as err:
            body = (
                err.body.decode(errors="replace")
                if isinstance(err.body, bytes)
                else str(err.body or "")
            )
            status = err.status or 0
            hint = {
                403: "; the ServiceAccount needs the RBAC of packaging/kubernetes/rbac.yaml",
                404: "; set node.name to this node's Kubernetes node name",
                409: "; the node changed meanwhile, the action can be retried",
            }.get(status, "; redirects are not followed" if 300 <= status < 400 else "")
            hint = (hints or {}).get(status, hint)
            raise AdapterError(
                f"Kubernetes API {what}: HTTP {err.status} {err.reason}: {body[:500]}{hint}"
            ) from err
        except Exception as err:  # urllib3 connection/timeouts: the API server is unreachable
            raise AdapterError(
                f"Kubernetes API {what}: {type(err).__name__}: {err}; "
                "check that the API server is reachable"
            ) from err
        try:
            return json.loads(data) if data else {}
        except ValueError as err:
            raise AdapterError(
                f"Kubernetes API {what}: answer is not JSON: {data[:200]!r}"
            ) from err

    def _only_own(self, node: str, action: str) -> str:
        """``node``, checked to be this agent's own: it never acts on another node."""
        node = check_node_name(node)
        if node != self.own_node:
            raise AdapterError(
                f"refusing to {action} {node}: the kubernetes adapter acts only on its own node "
                f"{self.own_node} (node.name, else NODE_AGENT_NODE_NAME, else the hostname); "
                "nothing sent"
            )
        return node

    def _get(self, node: str) -> dict[str, Any]:
        what = f"GET node {node}"
        return _node(self._call(what, self.api.read_node, node), what, node)

    def _our_taint(self, obj: dict[str, Any]) -> dict[str, Any] | None:
        for taint in (obj.get("spec") or {}).get("taints") or []:
            if isinstance(taint, dict) and taint.get("key") == self.taint_key:
                return taint
        return None

    def _state(self, obj: dict[str, Any]) -> NodeState:
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        ready = "Unknown"
        for cond in (obj.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "Ready":
                ready = {"True": "Ready", "False": "NotReady"}.get(cond.get("status"), "Unknown")
        unschedulable = bool(spec.get("unschedulable"))
        taint = self._our_taint(obj)
        reason = None
        if taint is not None:
            stored = (meta.get("annotations") or {}).get(ANN_REASON)
            reason = stored if is_agent_reason(stored) else f"node-agent: {taint.get('value', '')}"
        return NodeState(
            name=meta.get("name", ""),
            state=ready + (",SchedulingDisabled" if unschedulable else ""),
            drained=unschedulable,
            reason=reason,
        )

    def _set_condition(self, node: str, healthy: bool, reason_word: str, message: str) -> None:
        now = self._clock()
        body = {
            "status": {
                "conditions": [
                    {
                        "type": CONDITION_TYPE,
                        "status": "True" if healthy else "False",
                        "reason": reason_word,
                        "message": message,
                        "lastHeartbeatTime": now,
                        "lastTransitionTime": now,
                    }
                ]
            }
        }
        self._call(f"PATCH node {node} status", self.api.patch_node_status, node, body)

    def _cordon_and_taint(
        self,
        node: str,
        reason: str,
        extra_annotations: dict[str, Any],
        condition_reason: str,
        key: str | None,
    ) -> AdapterOutcome:
        obj = self._get(node)
        before = self._state(obj)
        if before.drained and not before.drained_by_agent:
            return AdapterOutcome.refused(
                f"{LEFT_AS_IS} {node} is cordoned by someone else (no {self.taint_key} "
                "taint); left as it is"
            )
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        if before.drained and before.reason == reason and not extra_annotations:
            return AdapterOutcome.already(
                f"kubernetes: {node} is already cordoned and tainted by node-agent "
                f"({reason}); not repeated"
            )
        taints = [t for t in spec.get("taints") or [] if t.get("key") != self.taint_key]
        taints.append({"key": self.taint_key, "value": taint_value(reason), "effect": "NoSchedule"})
        annotations = {ANN_REASON: reason, **extra_annotations}
        if key:
            annotations[ANN_KEY] = key
        if not spec.get("unschedulable"):
            annotations[ANN_CORDONED] = "true"
        body = {
            "metadata": {
                "resourceVersion": meta.get("resourceVersion"),
                "annotations": annotations,
            },
            "spec": {"unschedulable": True, "taints": taints},
        }
        what = f"PATCH node {node}"
        after = self._state(_node(self._call(what, self.api.patch_node, node, body), what, node))
        if not after.drained_by_agent:
            raise AdapterError(
                f"Kubernetes API {what}: the answer does not show {node} cordoned with the "
                f"{self.taint_key} taint ({after.state}); not taken as drained"
            )
        self._set_condition(node, False, condition_reason, reason)
        return AdapterOutcome.done(
            f"kubernetes: cordoned and tainted {node} "
            f"({self.taint_key}={taint_value(reason)}:NoSchedule; {reason})"
        )

    # -- the interface -----------------------------------------------------------------------

    def node_state(self, node: str) -> NodeState:
        return self._state(self._get(check_node_name(node)))

    def list_nodes(self) -> list[NodeState]:
        data = self._call("LIST nodes", self.api.list_node)
        items = data.get("items") if isinstance(data, dict) else None
        if not isinstance(items, list) or data.get("kind") != "NodeList":
            raise AdapterError(
                f"Kubernetes API LIST nodes: the answer is not a NodeList: {str(data)[:200]}; "
                "the share of drained nodes is unknown"
            )
        return [self._state(_node(item, "LIST nodes")) for item in items]

    def drain(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        node = self._only_own(node, "drain")
        reason = sanitise_reason(reason)
        return self._cordon_and_taint(node, reason, {}, "NodeAgentDrained", key)

    def replace(
        self, node: str, reason: str, *, key: str | None = None, evidence: str | None = None
    ) -> AdapterOutcome:
        """Cordon and taint; the evidence file is named in the detail (the journal and
        report), on the node's own disk."""
        node = self._only_own(node, "replace")
        text = sanitise_reason(reason)
        if not text.startswith("node-agent: replace:"):
            text = sanitise_reason("node-agent: replace: " + text[len("node-agent:") :].strip())
        return self._cordon_and_taint(node, text, {}, "NodeAgentReplace", key)

    def restart(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        node = self._only_own(node, "restart")
        reason = sanitise_reason(reason)
        cordoned = self._cordon_and_taint(
            node, reason, {ANN_REBOOT: self._clock()}, "NodeAgentRebootRequested", key
        )
        if cordoned.status is AdapterStatus.REFUSED:
            return AdapterOutcome.refused(
                f"refusing to request a reboot of {node}: it is cordoned by someone else "
                f"(no {self.taint_key} taint); left as it is"
            )
        return AdapterOutcome.done(
            f"{REBOOT_REQUESTED} Kubernetes has no reboot API; {node} is cordoned and "
            f"annotated {ANN_REBOOT} for a reboot operator ({reason})"
        )

    def resume(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        node = self._only_own(node, "resume")
        reason = sanitise_reason(reason)
        obj = self._get(node)
        state = self._state(obj)
        if self._our_taint(obj) is None:
            if state.drained:
                return AdapterOutcome.refused(
                    f"refusing to resume {node}: it is cordoned by someone else (no "
                    f"{self.taint_key} taint); uncordon it by hand (kubectl uncordon {node})"
                )
            return AdapterOutcome.already(
                f"kubernetes: {node} already in service; nothing to resume"
            )
        meta, spec = obj.get("metadata") or {}, obj.get("spec") or {}
        agent_cordoned = (meta.get("annotations") or {}).get(ANN_CORDONED) == "true"
        taints = [t for t in spec.get("taints") or [] if t.get("key") != self.taint_key]
        new_spec: dict[str, Any] = {"taints": taints}
        if agent_cordoned:
            new_spec["unschedulable"] = False
        body = {
            "metadata": {
                "resourceVersion": meta.get("resourceVersion"),
                "annotations": {
                    ANN_REASON: None,
                    ANN_CORDONED: None,
                    ANN_REBOOT: None,
                    ANN_KEY: None,
                },
            },
            "spec": new_spec,
        }
        self._call(f"PATCH node {node}", self.api.patch_node, node, body)
        self._set_condition(node, True, "NodeAgentHealthy", reason)
        kept = "" if agent_cordoned else " (left cordoned: the agent did not cordon it)"
        return AdapterOutcome.done(
            f"kubernetes: removed {self.taint_key} taint from {node}{kept}; {reason}"
        )

    def restart_job(
        self, node: str, job: str, reason: str, *, key: str | None = None
    ) -> AdapterOutcome:
        """Delete the hung pod ``job`` (``pod:[<ns>/]<name>@<uid>``) on ``node``; its controller
        recreates it. Raises AdapterError for another kind of job, a pod on another node or of
        another uid, a pod without a controller, or an API error; a pod that no longer runs
        is ``already`` (detail ``job-not-running:``)."""
        from kubernetes import client

        node, reason = self._only_own(node, "restart a job on"), sanitise_reason(reason)
        _, ident = check_job_id(
            job, accepts=(POD_JOB,), adapter="Kubernetes", node=node, what="pods"
        )
        ident, _, uid = ident.partition("@")
        namespace, _, name = ident.rpartition("/")
        namespace = namespace or self.pod_namespace
        if len(name) > 253:
            raise AdapterError(
                f"the Kubernetes adapter restarts only pods running on {node}; "
                f"job {job} names a pod longer than 253 characters"
            )
        where = f"pod {namespace}/{name}"
        pod = self._call(
            f"GET {where}",
            self.api.read_namespaced_pod,
            name,
            namespace,
            hints={
                404: f"; no such pod: the job id {job} came from a training "
                "process; check adapter.kubernetes.pod_namespace for "
                "pod:<name> ids"
            },
        )
        not_running = _pod_not_running(pod, where, reason, uid, node, job)
        if not_running is not None:
            return not_running
        owner = _controller(pod, where)
        body = client.V1DeleteOptions(preconditions=client.V1Preconditions(uid=uid))
        self._call(
            f"DELETE {where}",
            self.api.delete_namespaced_pod,
            name,
            namespace,
            body=body,
            hints={
                404: "; the pod is already gone (restarted or ended)",
                409: "; the pod was replaced meanwhile (another uid): not deleted",
            },
        )
        return AdapterOutcome.done(
            f"kubernetes: deleted {where} on {node} (uid {uid}); its controller "
            f"{owner.get('kind')}/{owner.get('name')} creates it again; {reason}"
        )


def _pod_not_running(
    pod: dict[str, Any], where: str, reason: str, uid: str, node: str, job: str
) -> AdapterOutcome | None:
    """``already`` for a pod being deleted or not Running; None for a running pod of ``uid``
    on ``node``; AdapterError for a pod of another uid (the environment named someone else's
    pod) or one on another node."""
    meta, spec = pod.get("metadata") or {}, pod.get("spec") or {}
    if meta.get("uid") != uid:
        raise AdapterError(
            f"refusing to delete {where}: its uid is {meta.get('uid')!r}, but "
            f"the hung process runs in pod uid {uid} (its kubepods "
            "cgroup); the name came from the process's environment, which "
            "named another pod: nothing deleted, check the evidence"
        )
    on = spec.get("nodeName")
    if on != node:
        raise AdapterError(
            f"the Kubernetes adapter restarts only pods running on {node}; "
            f"job {job} is {where} on {on or 'no node (not scheduled)'}; "
            "not deleted"
        )
    phase = (pod.get("status") or {}).get("phase") or "Unknown"
    if meta.get("deletionTimestamp"):
        return AdapterOutcome.already(
            f"{JOB_NOT_RUNNING} {where} is already being deleted (since "
            f"{meta['deletionTimestamp']}); nothing deleted; {reason}"
        )
    if phase != "Running":
        return AdapterOutcome.already(
            f"{JOB_NOT_RUNNING} {where} is {phase}, not Running; nothing deleted; {reason}"
        )
    return None


def _controller(pod: dict[str, Any], where: str) -> dict[str, Any]:
    """The pod's controller (its ``ownerReferences`` entry with ``controller``), which recreates
    it; AdapterError for a bare pod, which deleting would end for good."""
    owners = (pod.get("metadata") or {}).get("ownerReferences") or []
    owner = next((o for o in owners if isinstance(o, dict) and o.get("controller")), None)
    if owner is None:
        raise AdapterError(
            f"refusing to delete {where}: it has no controller "
            "(metadata.ownerReferences), so deleting it would end the job "
            "for good instead of restarting it; restart it by hand"
        )
    return owner
