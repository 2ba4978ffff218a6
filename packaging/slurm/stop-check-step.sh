#!/bin/bash
# Run node-agent stop-check over this job's nodes between attempts: source it (or copy these
# lines) in the batch script after the training step failed and before requeue or the next
# attempt. One task per node; rank 0 (the first node) writes stop-check.json; each node grades
# itself, and with --act drains itself through node-agent's guards (docs/stop_check.md).
#
#   srun ... python train.py || { . /usr/share/node-agent/stop-check-step.sh; scontrol requeue "$SLURM_JOB_ID"; }
#
# Needs: node-agent on every node, a directory every node can write (STOP_CHECK_OUT), and a free
# TCP port on the first node (STOP_CHECK_PORT).
set -u
STOP_CHECK_OUT="${STOP_CHECK_OUT:-$HOME/stop-check/$SLURM_JOB_ID}"
MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
MASTER_PORT="${STOP_CHECK_PORT:-29533}"
export MASTER_ADDR MASTER_PORT
mkdir -p "$STOP_CHECK_OUT"
# --kill-on-bad-exit=0: a node graded ERROR exits 3, and the other nodes must still finish.
srun --nodes="$SLURM_JOB_NUM_NODES" --ntasks="$SLURM_JOB_NUM_NODES" --ntasks-per-node=1 \
     --kill-on-bad-exit=0 --time=10 \
     node-agent stop-check --out "$STOP_CHECK_OUT" ${STOP_CHECK_ARGS:---replay --act}
echo "stop-check: $STOP_CHECK_OUT/stop-check.json" >&2
