"""The scheduler adapter interface: the one small surface remediation acts through.

Every adapter (``log``, ``slurm``, ``kubernetes``, ``webhook``) implements
:class:`SchedulerAdapter`. An adapter that the scheduler refuses, or that cannot reach it,
raises :class:`AdapterError` whose message carries the scheduler's own words (stderr, HTTP
body), so the journal records why an action failed and the agent itself never crashes.

Every action returns an :class:`AdapterOutcome`: what happened as an :class:`AdapterStatus`
(``done``, ``already`` in that state, ``refused`` because the drain is someone else's) and the
operator-readable ``detail`` for the journal and the report. Callers decide on the status,
never on the detail's words. ``failed`` is what the executor records for an AdapterError.

Job ids (``restart_job``) come from training processes' environments and heartbeat files,
which training users write: they are untrusted text. :func:`check_job_id` is the one
validator; each adapter passes the job kinds it can restart (:class:`JobKind`).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

REASON_PREFIX = "node-agent:"  # every drain reason the agent writes starts with this
MAX_REASON_LEN = 200  # Slurm keeps long reasons, but sinfo -R and humans read the first line
_NODE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_NODE_MAX_LEN = 63
#: the job kinds node_agent.heartbeat writes (docs/training_hangs.md): slurm:$SLURM_JOB_ID,
#: torchelastic:$TORCHELASTIC_RUN_ID, pod:<name> or pod:<namespace>/<name>, ppid:<launcher pid>;
#: a job the kernel vouched for carries what the adapter checks: ``slurm:<id>@uid:<uid>`` (the
#: hung process's uid, :func:`split_job_uid`), ``pod:<ns>/<name>@<pod uid>``
JOB_KINDS = ("slurm", "torchelastic", "pod", "ppid")
#: prefix training_progress gives a job it cannot vouch for (TrainingProcess.job_verified)
UNVERIFIED = "unverified:"
# pod:<namespace>/<name>@<uid> is at most 63 + 1 + 253 + 1 + 36 after its prefix
MAX_JOB_LEN = 360
# A job id any adapter may see: a known kind, then letters, digits and ._:/@+- only (no
# spaces, quotes, shell or scontrol metacharacters, no "="), starting with a letter or digit.
_JOB_RE = re.compile(r"^(?P<kind>[a-z]+):(?P<id>[A-Za-z0-9][A-Za-z0-9._:/@+-]*)$")


@dataclass(frozen=True)
class NodeState:
    name: str
    state: str  # scheduler's words, e.g. "IDLE", "DRAIN", "Ready"
    drained: bool
    reason: str | None  # drain reason as the scheduler stores it
    #: False where the adapter cannot read the scheduler (log: nothing is drained; webhook: the
    #: receiver does not say): ``drained`` then says nothing, and nothing is decided from it
    known: bool = True

    @property
    def drained_by_agent(self) -> bool:
        """True when the drain reason is one the agent wrote (so the agent may undo it)."""
        return self.drained and is_agent_reason(self.reason)


class AdapterError(Exception):
    """The scheduler refused or failed; the message includes its stderr or HTTP body."""


class AdapterStatus(str, enum.Enum):
    """What one adapter action did (the executor decides on it; the detail is for people)."""

    DONE = "done"  # the scheduler did what was asked (a request recorded counts)
    ALREADY = "already"  # it already was in that state, or the job no longer runs: nothing sent
    REFUSED = "refused"  # someone else's drain: left as it is, their reason kept
    FAILED = "failed"  # the scheduler refused or did not answer (an AdapterError, recorded)

    def __str__(self) -> str:
        return str(self.value)


@dataclass(frozen=True)
class AdapterOutcome:
    """An adapter action's result: its :class:`AdapterStatus` and a detail line for the
    journal and the report (``slurm: drained gpu-01 (Reason=node-agent: FAULT xid79 gpu:5)``).
    """

    status: AdapterStatus
    detail: str

    @classmethod
    def done(cls, detail: str) -> AdapterOutcome:
        return cls(AdapterStatus.DONE, detail)

    @classmethod
    def already(cls, detail: str) -> AdapterOutcome:
        return cls(AdapterStatus.ALREADY, detail)

    @classmethod
    def refused(cls, detail: str) -> AdapterOutcome:
        return cls(AdapterStatus.REFUSED, detail)

    @classmethod
    def failed(cls, detail: str) -> AdapterOutcome:
        return cls(AdapterStatus.FAILED, detail)

    @property
    def changed(self) -> bool:
        """True when the scheduler was changed by this action."""
        return self.status is AdapterStatus.DONE


@runtime_checkable
class SchedulerAdapter(Protocol):
    name: str  # "log" | "slurm" | "kubernetes" | "webhook"

    def node_state(self, node: str) -> NodeState: ...

    # Each action returns an AdapterOutcome. ``key`` is the action's idempotency key (the
    # same on every retry of one fault, remediation/executor.py): an adapter that talks to
    # something that can hold or deduplicate it (a webhook receiver, a node annotation)
    # passes it on. A drain of a node the agent already drained is ``already``; a drain,
    # replace, restart or resume of a node someone else drained is ``refused`` (left as is).
    def drain(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome: ...

    def resume(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome: ...

    # a reboot request
    def restart(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome: ...

    # drain + mark for replacement; ``evidence`` names the driver bug report taken before it
    # (a path on the node, remediation/evidence.py), for the people who repair the node
    def replace(
        self, node: str, reason: str, *, key: str | None = None, evidence: str | None = None
    ) -> AdapterOutcome: ...

    def list_nodes(self) -> list[NodeState]: ...  # all nodes it manages (blast radius)

    def restart_job(
        self, node: str, job: str, reason: str, *, key: str | None = None
    ) -> AdapterOutcome:
        """Restart the training job ``job`` (``slurm:<id>``, ``pod:<ns>/<name>``...) that hung
        on ``node``, through the scheduler; the node itself is not touched. Raises
        AdapterError for a job this adapter cannot restart or that does not run on ``node``.
        A job that is not running is left alone (``already``, detail ``job-not-running:``)."""
        ...


@dataclass(frozen=True)
class AdapterAction:
    """One action as :class:`ActionByName` hands it on: the node, reason and job checked."""

    action: str  # drain | resume | restart | replace | restart-job
    node: str  # check_node_name
    reason: str  # sanitise_reason
    job: str | None = None  # check_job_id
    key: str | None = None
    evidence: str | None = None

    @property
    def what(self) -> str:
        """``drain gpu-01``, ``restart-job slurm:42 on gpu-01``: the action in a detail."""
        on = f"{self.job} on {self.node}" if self.job is not None else self.node
        return f"{self.action} {on}"


class ActionByName:
    """The five actions of an adapter that does each one the same way, told the action's
    name (``log`` records it, ``webhook`` posts it): the node name, the reason and the job id
    are checked here, and the adapter gives :meth:`_act`."""

    def _act(self, act: AdapterAction) -> AdapterOutcome:
        raise NotImplementedError

    def _checked(
        self,
        action: str,
        node: str,
        reason: str,
        job: str | None = None,
        key: str | None = None,
        evidence: str | None = None,
    ) -> AdapterOutcome:
        node, reason = check_node_name(node), sanitise_reason(reason)
        if job is not None:
            check_job_id(job)
        return self._act(AdapterAction(action, node, reason, job, key, evidence))

    def drain(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        return self._checked("drain", node, reason, key=key)

    def resume(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        return self._checked("resume", node, reason, key=key)

    def restart(self, node: str, reason: str, *, key: str | None = None) -> AdapterOutcome:
        return self._checked("restart", node, reason, key=key)

    def replace(
        self, node: str, reason: str, *, key: str | None = None, evidence: str | None = None
    ) -> AdapterOutcome:
        return self._checked("replace", node, reason, key=key, evidence=evidence)

    def restart_job(
        self, node: str, job: str, reason: str, *, key: str | None = None
    ) -> AdapterOutcome:
        return self._checked("restart-job", node, reason, job=job, key=key)


@dataclass(frozen=True)
class JobKind:
    """A job kind an adapter restarts: ``<kind>:<id>`` with ``id`` matching ``id_re``.

    >>> SLURM = JobKind("slurm", re.compile(r"\\d+(_\\d+)?"), "slurm:1234 or slurm:1234_7")
    """

    kind: str
    id_re: re.Pattern[str]
    example: str  # what to show the operator, e.g. "slurm:1234 or slurm:1234_7"


_JOB_UID = re.compile(r"^(?P<job>.+)@uid:(?P<uid>\d{1,10})$")


def split_job_uid(job: str) -> tuple[str, int | None]:
    """``("slurm:1234", 1001)`` for ``slurm:1234@uid:1001``: a verified job carries the uid of
    the hung process (``training/processes.py``), for the adapter to compare with the job's
    owner; ``(job, None)`` when it carries none.

    >>> split_job_uid("slurm:1234@uid:1001")
    ('slurm:1234', 1001)
    """
    match = _JOB_UID.fullmatch(job) if isinstance(job, str) else None
    return (match.group("job"), int(match.group("uid"))) if match else (job, None)


def show_job(job: object, max_len: int = 80) -> str:
    """An untrusted job id for a message: ``repr`` (control characters escaped), bounded."""
    text = repr(job)
    return text if len(text) <= max_len else text[: max_len - 4] + "...'"


def check_job_id(
    job: str,
    *,
    accepts: Sequence[JobKind] = (),
    adapter: str = "node-agent",
    node: str = "this node",
    what: str = "jobs",
) -> tuple[str, str]:
    """Validate the untrusted job id ``job``; returns ``(kind, id)`` or raises AdapterError.

    Every job must be ``<kind>:<id>`` with a kind of :data:`JOB_KINDS` and an id of letters,
    digits and ``._:/@+-`` (at most :data:`MAX_JOB_LEN` characters in all). With ``accepts``,
    the kind must be one of them and its id must match the kind's ``id_re``; the message then
    says which jobs ``adapter`` restarts (``what``) and on which ``node``.

    >>> check_job_id("slurm:1234")
    ('slurm', '1234')
    """
    if isinstance(job, str) and job.startswith(UNVERIFIED):
        raise AdapterError(
            f"refusing to restart job {show_job(job)}: the agent could not verify which job the "
            "hung process belongs to (its environment was unreadable, only a heartbeat file "
            "named the job, or the Slurm job id in its environment is not the one slurmd's "
            "cgroup holds it in); restart the job by hand after checking the evidence"
        )
    match = _JOB_RE.fullmatch(job) if isinstance(job, str) and len(job) <= MAX_JOB_LEN else None
    if match is None or match.group("kind") not in JOB_KINDS:
        raise AdapterError(
            f"refusing job id {show_job(job)}: a job id must be <kind>:<id> with kind one of "
            f"{', '.join(JOB_KINDS)} and an id of letters, digits and ._:/@+- (at most "
            f"{MAX_JOB_LEN} characters); it comes from a training process's environment or "
            "heartbeat file, so it is checked before any scheduler sees it"
        )
    kind, ident = match.group("kind"), match.group("id")
    if not accepts:
        return kind, ident
    for rule in accepts:
        if kind == rule.kind and rule.id_re.fullmatch(ident):
            return kind, ident
    expected = " or ".join(rule.example for rule in accepts)
    raise AdapterError(
        f"the {adapter} adapter restarts only {what} running on {node}; job "
        f"{show_job(job)} is not one (expected {expected})"
    )


def is_agent_reason(reason: str | None) -> bool:
    return reason is not None and reason.strip().startswith(REASON_PREFIX)


def check_node_name(node: str) -> str:
    """Return ``node`` if it is a safe host name for an argv/URL, else raise AdapterError."""
    if not isinstance(node, str) or len(node) > _NODE_MAX_LEN or not _NODE_RE.fullmatch(node):
        raise AdapterError(
            f"refusing node name {node!r}: a node name must match "
            f"{_NODE_RE.pattern} and be at most {_NODE_MAX_LEN} characters; "
            "set node.name in the config to the scheduler's name for this host"
        )
    return node


def sanitise_reason(reason: str, max_len: int = MAX_REASON_LEN) -> str:
    """Printable ASCII only, no quotes/backslashes/newlines/``=``-confusion, bounded length.

    Always starts with :data:`REASON_PREFIX` (added when missing), so that a drain the agent
    wrote can be told from one an operator wrote.
    """
    text = str(reason).replace("\r", " ").replace("\n", " ").replace("\t", " ")
    out = []
    for ch in text:
        if ch in "\"'`\\$;&|<>" or not (32 <= ord(ch) < 127):
            out.append("_" if (32 <= ord(ch) < 127) else "?")
        else:
            out.append(ch)
    text = re.sub(r"\s+", " ", "".join(out)).strip()
    if not text.startswith(REASON_PREFIX):
        text = f"{REASON_PREFIX} {text}".rstrip()
    if len(text) > max_len:
        text = text[: max_len - 3].rstrip() + "..."
    return text
