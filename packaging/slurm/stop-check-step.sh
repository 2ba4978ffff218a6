#!/bin/bash
# Run node-agent stop-check over this job's nodes between attempts: run it (or source it) in the
# batch script after the training step failed and before requeue or the next attempt. One task
# per node; rank 0 (the first node) writes stop-check.json; each node grades itself, and with
# --act drains itself through node-agent's guards (docs/stop_check.md).
#
#   srun ... python train.py || { /usr/share/node-agent/stop-check-step.sh; scontrol requeue "$SLURM_JOB_ID"; }
#
# Sourced or run, it works in a child shell of its own: the caller's shell options (set -e,
# set -u), PATH and variables are left as they were; export STOP_CHECK_* when you set them.
#
# The job key: every message between the ranks is signed with a key made here, once per run
# (32 random bytes as hex, mode 0600, the job user's), copied to every node of the job with
# sbcast to a node-local file with a random name (STOP_CHECK_KEY_DIR, default /tmp) and removed
# from every node when the step ends. A local user who takes the rendezvous port cannot sign, so
# the ranks stop with exit 2 and name nothing. Where sbcast cannot be used, set STOP_CHECK_KEY to
# a key file in a directory every node shares and only the job's user can read.
#
# Needs: node-agent on every node, a directory every node can write (STOP_CHECK_OUT), and a free
# TCP port on the first node (STOP_CHECK_PORT).

if (return 0 2>/dev/null); then  # sourced: run as a child, and give back its status
    STOP_CHECK_OUT="${STOP_CHECK_OUT:-}" STOP_CHECK_PORT="${STOP_CHECK_PORT:-}" \
        STOP_CHECK_ARGS="${STOP_CHECK_ARGS:-}" STOP_CHECK_KEY="${STOP_CHECK_KEY:-}" \
        STOP_CHECK_KEY_DIR="${STOP_CHECK_KEY_DIR:-}" "${BASH:-/bin/bash}" "${BASH_SOURCE[0]}"
    return
fi

set -u
PATH="/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin${NODE_AGENT_PATH:+:$NODE_AGENT_PATH}"
export PATH
umask 077
: "${SLURM_JOB_ID:?stop-check-step.sh runs inside a Slurm job (sbatch or salloc)}"
out="${STOP_CHECK_OUT:-${HOME:?set STOP_CHECK_OUT or HOME}/stop-check/$SLURM_JOB_ID}"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${STOP_CHECK_PORT:-29533}"
export MASTER_ADDR MASTER_PORT
mkdir -p "$out" || exit 2

key="${STOP_CHECK_KEY:-}"
if [ -z "$key" ]; then
    made="$(mktemp)" || exit 2
    trap 'rm -f "$made"' EXIT
    od -An -N32 -tx1 /dev/urandom | tr -d ' \n' >"$made" || exit 2
    key="${STOP_CHECK_KEY_DIR:-/tmp}/node-agent-stop-check-$SLURM_JOB_ID-$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n').key"
    # --force: a name this run chose at random; node-agent refuses a key another user owns
    sbcast --force --preserve "$made" "$key" || {
        echo "stop-check: sbcast could not copy the job key to the nodes; nothing run" >&2
        exit 2
    }
fi

# --kill-on-bad-exit=0: a node graded ERROR exits 3, and the other nodes must still finish.
# Each task removes the node's copy of the key when it ends (a shared STOP_CHECK_KEY is kept).
# shellcheck disable=SC2086  # STOP_CHECK_ARGS is a list of options, split on purpose
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
     --kill-on-bad-exit=0 --time=10 \
     /bin/sh -c 'k="$1"; drop="$2"; shift 2; node-agent stop-check --key-file "$k" "$@"; rc=$?
                 [ "$drop" = yes ] && rm -f "$k"; exit "$rc"' \
     stop-check "$key" "$([ -z "${STOP_CHECK_KEY:-}" ] && echo yes || echo no)" \
     --out "$out" ${STOP_CHECK_ARGS:---replay --act}
rc=$?
echo "stop-check: $out/stop-check.json (exit $rc)" >&2
exit "$rc"
