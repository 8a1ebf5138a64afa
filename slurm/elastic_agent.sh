#!/usr/bin/env bash
# One node's task of an elastic job (slurm/pretrain.sh with ELASTIC_MIN_NODES): its torchrun agent.
#
#   slurm/elastic_agent.sh EXIT_DIR COMMAND...
#
# COMMAND is the torchrun command line; __IS_HOST__ in it becomes is_host=1 on the job's first node
# and is_host=0 elsewhere (in the value of --rdzv-conf). The agent's exit code goes to EXIT_DIR/<node>, so
# that the batch script can tell "finished on the nodes that were left" from a failure (srun reports
# only the highest code of its tasks, and a lost node's is a kill).
set -uo pipefail

exit_dir=$1
shift
args=()
for word in "$@"; do
    word=${word//__IS_HOST__/is_host=$((SLURM_NODEID == 0))}
    args+=("$word")
done

# The time-limit SIGUSR1 (or `scancel --signal=USR1`): torchrun has no handler for it and would die of it,
# and its ranks' exit 75 would only make it restart them. So torchrun ignores it, and this shell sends the
# agent SIGTERM instead: the agent stops its ranks with SIGTERM, which they take as preemption (checkpoint
# at the step boundary, exit 75; torchrun waits 30 s before SIGKILL), and ends. This task then exits 75,
# which the batch script turns into a requeue.
forwarded=0
agent=""
# shellcheck disable=SC2317  # trap handler
on_usr1() {
    forwarded=1
    [[ -z $agent ]] || kill -TERM "$agent" 2>/dev/null || true
}
trap on_usr1 USR1
(trap '' USR1; exec "${args[@]}") &
agent=$!
# `wait` returns early when the trap runs: wait again until the agent has really exited.
while true; do
    wait "$agent"
    rc=$?
    kill -0 "$agent" 2>/dev/null || break
done
((forwarded)) && rc=75
echo "$rc" >"$exit_dir/${SLURMD_NODENAME:-$(hostname)}"
exit "$rc"
