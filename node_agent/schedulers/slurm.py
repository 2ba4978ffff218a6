"""The ``slurm`` adapter: drain, resume, reboot and replace requests through ``scontrol``.

Commands (argv lists through :func:`node_agent.proc.run`, always with ``adapter.slurm.timeout_s``)::

    scontrol update NodeName=N State=DRAIN Reason="node-agent: ERROR xid79 gpu:5"
    scontrol update NodeName=N State=RESUME Reason="node-agent: ..."
    scontrol reboot ASAP nextstate=RESUME reason="node-agent: ..." N
    scontrol update NodeName=N State=FAIL Reason="node-agent: replace: ..."     (replace)
    scontrol show node -o [N]                                                 (state)
    squeue --noheader --array --states=all --jobs=J --format=%A|%i|%T|%N|%U   (restart_job)
    squeue --noheader --array --states=RUNNING --jobs=J --nodelist=N --format=%A
    scontrol requeue J                                                        (restart_job)

Node state is read from ``scontrol show node -o`` (one ``Key=Value`` line per node), which every
Slurm release prints the same way; ``sinfo --json`` exists in 22.05 (openapi v0.0.38) but its
field names change from release to release, so it is not used.

Reboot when Slurm cannot reboot: ``scontrol reboot`` needs ``RebootProgram`` in slurm.conf;
without it scontrol answers ``RebootProgram isn't defined`` and nothing happens. The adapter then
does not fail the restart: it makes sure the node is drained (with the given reason), and
returns a detail line starting with ``reboot-unavailable:`` that says so, so the remediation goes
on to the re-test with the node out of service. This is also the stand-in the test cluster
exercises (it has no RebootProgram: a test cannot reboot its host). To have the agent really
reboot nodes, set ``RebootProgram`` (e.g. ``/usr/sbin/reboot``) in slurm.conf.

Someone else's drain wins: a node drained with a reason that does not start with
``node-agent:`` is never resumed, rebooted, drained again or replaced: each returns ``refused``
and leaves it and its reason as they are (the drain's and replace's detail starts with
``left-as-is:``). A drain of a node the agent already drained with the same reason, a replace
of a node already FAIL with it, and a resume of a node in service are ``already``: nothing sent.
The idempotency key cannot travel: Slurm keeps one Reason per node, read by ``sinfo -R``.

A failing or hung ``scontrol`` raises :class:`AdapterError` with its stderr; it never hangs the agent.

Restarting a hung job (``restart_job``): only ``slurm:<job id>@uid:<uid>`` (``1234``, or
``1234_7`` for an array task; the uid is the hung process's, ``training/processes.py``), and
only a job that Slurm itself says is RUNNING with this node in its allocation and that belongs
to that uid (``%U``, the job's numeric UserId). The job id comes from a training process
(untrusted): a job elsewhere, or another user's job, is never requeued, and a job id without
the process's uid (an older agent's plan, an operator's hand-written one) is refused, since
whose job it is cannot be checked. The check uses ``squeue`` with a fixed ``%``-format of
fields users cannot set
(``scontrol show job -o`` prints the user's JobName, WorkDir and Command among its
``Key=Value`` fields, where ``x NodeList=gpu-01`` could pass for a field). A job that is not
running (already requeued, by another node's agent for the same hang, or ended) is left alone
(``already``): the detail starts with ``job-not-running:``. ``scontrol requeue`` kills the job
and puts it back in the queue (``Restarts`` counts up; Slurm holds it back for a short
BeginTime).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from node_agent import proc
from node_agent.schedulers.base import (
    AdapterError,
    AdapterOutcome,
    JobKind,
    NodeState,
    check_job_id,
    check_node_name,
    sanitise_reason,
    show_job,
    split_job_uid,
)

if TYPE_CHECKING:
    from node_agent.config import Config

REPLACE_PREFIX = "node-agent: replace:"
REBOOT_UNAVAILABLE = "reboot-unavailable:"  # detail prefix: no RebootProgram (see above)
LEFT_AS_IS = "left-as-is:"  # detail prefix: drained by someone else, their reason kept
JOB_NOT_RUNNING = "job-not-running:"  # detail prefix: restart_job found nothing to requeue
#: the jobs restart_job accepts: a Slurm job id, or <array job id>_<task id>
SLURM_JOB = JobKind(
    "slurm",
    re.compile(r"\d+(_\d+)?@uid:\d{1,10}"),
    "slurm:<job id>@uid:<uid of the hung process>, e.g. slurm:1234@uid:1001 or "
    "slurm:1234_7@uid:1001",
)
# State flags after the base state ("IDLE+DRAIN", "MIXED+DRAIN", "DOWN+FAIL"): any of these
# means the scheduler will not start new jobs on the node (drained or draining).
_DRAIN_FLAGS = {"DRAIN", "DRAINING", "DRAINED", "FAIL", "FAILING"}
_REASON_SUFFIX_RE = re.compile(r"\s*\[[^\]@]*@[^\]]*\]\s*$")  # " [root@2025-01-01T00:00:00]"
_FIELD_RE = re.compile(r"(\S+?)=(.*?)(?=\s+[A-Za-z_]+=|$)")

Runner = Callable[..., proc.ProcResult]


def parse_show_node(text: str) -> list[NodeState]:
    """Parse ``scontrol show node -o`` output (one node per line) into NodeStates; AdapterError
    for a node line without its ``State=`` (a cut or foreign answer is never read as in service).

    ``Reason=`` is the last field and may hold spaces and ``=``; Slurm appends
    ``[user@time]`` to it, which is removed so that the reason reads as it was written.
    """
    nodes = []
    for line in text.splitlines():
        line = line.strip()
        if not line.startswith("NodeName="):
            continue
        reason = None
        head, sep, tail = line.partition(" Reason=")
        if sep:
            reason = _REASON_SUFFIX_RE.sub("", tail).strip() or None
        fields = {m.group(1): m.group(2).strip() for m in _FIELD_RE.finditer(head)}
        state = fields.get("State")
        if not state:
            raise AdapterError(
                f"scontrol show node -o: a line without State= ({line[:120]!r}): the answer is "
                "cut or not Slurm's; the node's state cannot be read"
            )
        flags = set(state.upper().rstrip("*").split("+")[1:])
        base = state.upper().split("+")[0].rstrip("*~#!%$@^-")
        drained = bool(flags & _DRAIN_FLAGS) or base in {"DRAINED", "DRAINING", "DRAIN", "FAIL"}
        nodes.append(
            NodeState(name=fields["NodeName"], state=state, drained=drained, reason=reason)
        )
    return nodes


class SlurmAdapter:
    name = "slurm"

    def __init__(
        self,
        scontrol: str = "scontrol",
        timeout_s: float = 15,
        env: Mapping[str, str] | None = None,
        runner: Runner = proc.run,
        squeue: str = "squeue",
    ) -> None:
        self.scontrol = scontrol
        self.squeue = squeue
        self.timeout_s = float(timeout_s)
        self.env = dict(env) if env is not None else None  # None: inherit (SLURM_CONF etc.)
        self._run = runner

    @classmethod
    def from_config(cls, config: Config) -> SlurmAdapter:
        return cls(
            scontrol=config.adapter.slurm.scontrol,
            timeout_s=config.adapter.slurm.timeout_s,
            squeue=config.adapter.slurm.squeue,
        )

    # -- plumbing ----------------------------------------------------------------------------

    def _scontrol(self, *args: str) -> proc.ProcResult:
        result = self._run([self.scontrol, *args], self.timeout_s, env=self.env)
        if result.not_found:
            raise AdapterError(
                f"{self.scontrol}: command not found; install slurm-client or "
                "set adapter.slurm.scontrol to its path"
            )
        return result

    def _checked(self, *args: str) -> str:
        result = self._scontrol(*args)
        if not result.ok:
            raise AdapterError(_failure(result))
        return result.stdout

    def _squeue(self, *args: str) -> list[list[str]]:
        """``squeue --noheader --array ARGS`` as rows of ``|``-separated fields."""
        result = self._run(
            [self.squeue, "--noheader", "--array", *args], self.timeout_s, env=self.env
        )
        if result.not_found:
            raise AdapterError(
                f"{self.squeue}: command not found; install slurm-client or "
                "set adapter.slurm.squeue to its path"
            )
        if not result.ok:
            raise AdapterError(_failure(result))
        return [line.strip().split("|") for line in result.stdout.splitlines() if line.strip()]

    # -- the interface -----------------------------------------------------------------------

    def node_state(self, node: str) -> NodeState:
        node = check_node_name(node)
        nodes = parse_show_node(self._checked("show", "node", "-o", node))
        for state in nodes:
            if state.name == node:
                return state
        raise AdapterError(
            f"`{self.scontrol} show node -o {node}` did not list node {node}; "
            "set node.name to the node's Slurm NodeName"
        )

    def list_nodes(self) -> list[NodeState]:
        return parse_show_node(self._checked("show", "node", "-o"))

    def drain(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        """Drain ``node``; a node someone else drained keeps their reason (refused, left as
        is); a node the agent already drained with this reason is ``already``."""
        node, reason = check_node_name(node), sanitise_reason(reason)
        current = self.node_state(node)
        if current.drained and not current.drained_by_agent:
            return _left_as_is(current, "drain")
        if current.drained and current.reason == reason:
            return AdapterOutcome.already(
                f"slurm: {node} is already {current.state} (Reason={reason}); not repeated"
            )
        self._checked("update", f"NodeName={node}", "State=DRAIN", f"Reason={reason}")
        return AdapterOutcome.done(f"slurm: drained {node} (Reason={reason})")

    def resume(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        """Resume ``node`` only if the agent drained it; someone else's drain is refused."""
        node, reason = check_node_name(node), sanitise_reason(reason)
        current = self.node_state(node)
        if not current.drained:
            return AdapterOutcome.already(
                f"slurm: {node} already in service ({current.state}); nothing to resume"
            )
        if not current.drained_by_agent:
            return AdapterOutcome.refused(
                f"refusing to resume {node}: it was drained by someone else "
                f"(Reason={current.reason!r}); resume it by hand with `scontrol update "
                f"NodeName={node} State=RESUME` if that drain is over"
            )
        result = self._scontrol("update", f"NodeName={node}", "State=RESUME", f"Reason={reason}")
        if not result.ok and (result.timed_out or self.node_state(node).drained):
            # (Slurm answers "Invalid node state" for some states it resumes all the same.)
            raise AdapterError(_failure(result))
        return AdapterOutcome.done(
            f"slurm: resumed {node} (was {current.state}: {current.reason}; {reason})"
        )

    def restart(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        """Ask Slurm to reboot ``node`` once idle; refused for a node someone else drained."""
        node, reason = check_node_name(node), sanitise_reason(reason)
        before = self.node_state(node)
        if before.drained and not before.drained_by_agent:
            return AdapterOutcome.refused(
                f"refusing to reboot {node}: it was drained by someone else "
                f"(Reason={before.reason!r}) and a reboot would replace their reason"
            )
        result = self._scontrol("reboot", "ASAP", "nextstate=RESUME", f"reason={reason}", node)
        if result.ok:
            return AdapterOutcome.done(
                f"slurm: reboot requested for {node} (ASAP, nextstate=RESUME, reason={reason})"
            )
        if "RebootProgram" in result.stderr + result.stdout and not result.timed_out:
            # Slurm cannot reboot this cluster's nodes; keep the node out of service instead.
            current = self.node_state(node)
            if not current.drained:
                self.drain(node, reason)
            return AdapterOutcome.done(
                f"{REBOOT_UNAVAILABLE} Slurm has no RebootProgram in slurm.conf, so {node} "
                f"was not rebooted; it stays drained ({current.reason or reason}) for the "
                "re-test. Set RebootProgram in slurm.conf to let the agent reboot nodes."
            )
        raise AdapterError(_failure(result))

    def replace(
        self, node: str, reason: str, *, key: str | None = None, evidence: str | None = None
    ) -> AdapterOutcome:
        """``State=FAIL``; the evidence file is named in the detail (the journal and report),
        not in Slurm's reason, which stays short for ``sinfo -R``."""
        node = check_node_name(node)
        text = sanitise_reason(reason)
        if not text.startswith(REPLACE_PREFIX):
            text = sanitise_reason(REPLACE_PREFIX + " " + text[len("node-agent:") :].strip())
        current = self.node_state(node)
        if current.drained and not current.drained_by_agent:
            return _left_as_is(current, "replace")
        if "FAIL" in current.state.upper() and current.reason == text:
            return AdapterOutcome.already(
                f"slurm: {node} is already {current.state} for replacement (Reason={text}); "
                "not repeated"
            )
        # FAIL: drained, and marked as expected to fail, so it stays out until repaired.
        self._checked("update", f"NodeName={node}", "State=FAIL", f"Reason={text}")
        return AdapterOutcome.done(
            f"slurm: {node} set to FAIL for hardware replacement (Reason={text})"
        )

    def restart_job(
        self, node: str, job: str, reason: str, *, key: str | None = None
    ) -> AdapterOutcome:
        """Requeue the Slurm job ``job`` (``slurm:<id>@uid:<uid>``) if it is RUNNING on
        ``node`` and belongs to ``uid`` (the hung process's).

        Raises AdapterError for another kind of job, a job id without the process's uid, a job
        Slurm does not know, a job id naming several array tasks, another user's job (or one
        whose owner squeue does not say), a job running only on other nodes, or a failed
        requeue. A job that is not running at all is left alone (detail ``job-not-running:``).
        """
        node, reason = check_node_name(node), sanitise_reason(reason)
        if isinstance(job, str) and job.startswith("slurm:") and split_job_uid(job)[1] is None:
            raise AdapterError(
                f"refusing to requeue Slurm job {show_job(job)}: the job id does not carry the "
                "uid of the hung process (slurm:<id>@uid:<uid>), so whose job it is cannot be "
                "checked against Slurm's; requeue it by hand (scontrol requeue) after checking"
            )
        _, ident = check_job_id(
            job, accepts=(SLURM_JOB,), adapter="Slurm", node=node, what="Slurm jobs"
        )
        job_id, uid = split_job_uid(ident)
        refuse = f"the Slurm adapter restarts only Slurm jobs running on {node}; job {job}"
        try:
            rows = self._squeue("--states=all", f"--jobs={job_id}", "--format=%A|%i|%T|%N|%U")
        except AdapterError as err:
            if "Invalid job id" not in str(err):
                raise
            rows = []
        if not rows:
            raise AdapterError(
                f"{refuse} is not known to Slurm (squeue: Invalid job id "
                "specified); the id came from a training process: check its "
                "SLURM_JOB_ID and the job with squeue"
            )
        if len(rows) != 1 or len(rows[0]) != 5:
            shown = ", ".join("|".join(r) for r in rows[:5]) or "nothing"
            raise AdapterError(
                f"{refuse} is not one running job: squeue --jobs={job_id} "
                f"listed {len(rows)} record(s) ({shown}); an array job id names "
                "all its tasks: the heartbeat should carry the task's own "
                "SLURM_JOB_ID"
            )
        unique_id, shown_id, state, nodelist, owner = rows[0]
        if not owner.isdigit():
            raise AdapterError(
                f"REFUSED: not requeueing Slurm job {shown_id}: squeue did not say whose job it "
                f"is (UserId {owner[:40]!r}), so it cannot be checked against the hung "
                f"process's uid {uid}; requeue it by hand after checking"
            )
        if int(owner) != uid:
            raise AdapterError(
                f"REFUSED: not requeueing Slurm job {shown_id}: it belongs to uid {owner}, but "
                f"the hung process that named it runs as uid {uid}; a user's process can name "
                "another user's job (SLURM_JOB_ID is the user's to set), so only the job's own "
                "processes may have it requeued. Check the process and the job by hand"
            )
        if state != "RUNNING":
            return AdapterOutcome.already(
                f"{JOB_NOT_RUNNING} Slurm job {shown_id} is {state}, not running; nothing "
                f"requeued (already requeued, e.g. by another node's agent for the same "
                f"hang, or ended); {reason}"
            )
        on_node = self._squeue(
            "--states=RUNNING", f"--jobs={unique_id}", f"--nodelist={node}", "--format=%A"
        )
        if [unique_id] not in on_node:
            raise AdapterError(
                f"{refuse} runs on {nodelist or 'no node'}, not on {node}; not requeued"
            )
        result = self._scontrol("requeue", unique_id)
        if not result.ok:
            raise AdapterError(_requeue_failure(result, shown_id))
        return AdapterOutcome.done(
            f"slurm: requeued job {shown_id} (JobId={unique_id}, was RUNNING on "
            f"{nodelist}); Slurm restarts it; {reason}"
        )


def _requeue_failure(result: proc.ProcResult, job: str) -> str:
    text = _describe(result)
    if "presently disabled" in text:
        return (
            f"{text}; job {job} cannot be requeued (submitted with --no-requeue, or "
            "JobRequeue=0 in slurm.conf): cancel it with scancel if it is hung"
        )
    if "Only batch jobs" in text:
        return (
            f"{text}; job {job} is an interactive (srun/salloc) job, which Slurm cannot "
            "requeue: cancel it with scancel if it is hung"
        )
    if "Access/permission denied" in text or "Invalid user" in text:
        return text + "; scontrol requeue needs SlurmUser, root or the job's owner"
    return text + "; check that slurmctld is up (`scontrol ping`) and SLURM_CONF points at it"


def _left_as_is(current: NodeState, action: str) -> AdapterOutcome:
    return AdapterOutcome.refused(
        f"{LEFT_AS_IS} {current.name} is already {current.state} by someone else "
        f"(Reason={current.reason!r}); not changed by {action}, their reason kept"
    )


def _describe(result: proc.ProcResult) -> str:
    text = result.describe_failure()
    err = " ".join(result.stderr.split())[:500] or " ".join(result.stdout.split())[:500]
    if err and err not in text:
        text += f" (stderr: {err})"
    return text


def _failure(result: proc.ProcResult) -> str:
    text = _describe(result)
    if "Invalid node name" in text or re.search(r"Node \S+ not found", text):
        return text + "; set node.name in the config to this node's Slurm NodeName"
    if "Access/permission denied" in text or "Invalid user" in text:
        return text + "; scontrol update needs SlurmUser or root: run the agent as root"
    return text + "; check that slurmctld is up (`scontrol ping`) and SLURM_CONF points at it"
