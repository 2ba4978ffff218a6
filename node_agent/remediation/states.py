"""The remediation vocabulary: a node's states, the actions of a plan step, a journal row's
state, who asked for a step, the kinds of restart.

Each is a ``str`` enum (:class:`~node_agent.model.Word`; :class:`StepAction` lives in the
model, beside the ``ActionRecord`` that names it) whose values are the strings the store keeps
on disk (``remediation.db`` columns ``state``, ``action``, ``trigger``, ``restart_kind``) and
that ``status`` shows, so an existing database reads unchanged and ``member == "drained"``
holds. :mod:`node_agent.remediation.plan` and the executor decide with them;
:mod:`node_agent.remediation.store` reads and writes them.
"""

from __future__ import annotations

from node_agent.model import Recovery, StepAction
from node_agent.model import Word as _Word

__all__ = [
    "RESTART_FOR_RECOVERY",
    "JournalState",
    "NodeState",
    "RestartKind",
    "StepAction",
    "Trigger",
]


class NodeState(_Word):
    """Where a node is in its remediation (DESIGN.md, "Remediation and safety")::

    in-service -> drained -> restarting -> retest -> in-service
                      \\-> fault -> awaiting-replacement
                      \\-> needs-operator   (set-healthy + act resume)
    in-service -> planned -> in-service   (a cloud's announced maintenance: drained ahead of it,
                                           resumed by a passing re-test after it)
    """

    IN_SERVICE = "in-service"
    DRAINED = "drained"
    RESTARTING = "restarting"
    RETEST = "retest"
    FAULT = "fault"
    AWAITING_REPLACEMENT = "awaiting-replacement"
    NEEDS_OPERATOR = "needs-operator"
    PLANNED = "planned"  # drained ahead of an announced maintenance (remedy planned)


class JournalState(_Word):
    """Where one journal row is: ``planned`` and ``started`` are the ones a crash can leave
    behind (completed once by the next run); the rest are a step's final ``ActionOutcome``."""

    PLANNED = "planned"
    STARTED = "started"
    DONE = "done"
    FAILED = "failed"
    REFUSED = "refused"
    DRY_RUN = "dry-run"


class Trigger(_Word):
    """Who asked for a step: the agent's own grading, or an operator's ``node-agent act``."""

    AUTO = "auto"  # every guard applies
    OPERATOR = "operator"  # the automatic guards are skipped: a person decided


class RestartKind(_Word):
    """How a node (or its GPU) is restarted."""

    GPU_RESET = "gpu-reset"
    REBOOT = "reboot"


#: the restart the driver's recovery action asks for (``nvmlGpuRecoveryAction_t``, NVML API
#: reference): NODE_REBOOT and SYSTEM_REBOOT ask for a reboot; GPU_RESET, DRAIN_AND_RESET and
#: BUS_RESET for a reset of the GPU (after its work is drained); DRAIN_P2P and
#: RECOVER_IMEX_DOMAIN ask for no reboot, so a GPU reset is tried first, as for an action newer
#: than this list (UNKNOWN) or none: a reset that does not clear the fault leads to a reboot
#: (the re-test after a reset plans the reboot).
RESTART_FOR_RECOVERY: dict[Recovery, RestartKind] = {
    Recovery.NONE: RestartKind.GPU_RESET,
    Recovery.GPU_RESET: RestartKind.GPU_RESET,
    Recovery.NODE_REBOOT: RestartKind.REBOOT,
    Recovery.DRAIN_P2P: RestartKind.GPU_RESET,
    Recovery.DRAIN_AND_RESET: RestartKind.GPU_RESET,
    Recovery.RECOVER_IMEX_DOMAIN: RestartKind.GPU_RESET,
    Recovery.BUS_RESET: RestartKind.GPU_RESET,
    Recovery.SYSTEM_REBOOT: RestartKind.REBOOT,
    Recovery.UNKNOWN: RestartKind.GPU_RESET,
}
