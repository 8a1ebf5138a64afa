#!/usr/bin/env bash
# Multi-node ViT pretraining: srun starts one task per GPU; each task finds its rank, the world
# size and the master address in Slurm's environment (pipeline/dist.py), so no ssh or hostfile.
#
#   sbatch slurm/pretrain.sh                                       # the demo config, defaults below
#   CONFIG=configs/pretrain/vit_b16_i21k.yaml RUN_DIR=runs/b16 sbatch slurm/pretrain.sh
#   OVERRIDES="train.steps=90000 train.lr=1e-3" sbatch --nodes=4 slurm/pretrain.sh
#   sbatch --nodes=1 --ntasks-per-node=2 --gpus-per-node=0 slurm/pretrain.sh   # a small (CPU) partition
#
# Submit from the repository root (the job runs there; its log goes to logs/, which is tracked so
# that it exists in a fresh clone: Slurm opens the log before the script starts).
#
# Preemption and time limits: Slurm sends SIGUSR1 to every task 300 s before the time limit
# (and `scancel --signal=USR1 <job>` does the same by hand). The trainer checkpoints at the next
# step boundary and exits with 75; this script then requeues the job, and the requeued job runs
# the same command on the same RUN_DIR, which resumes from its newest complete checkpoint.
#
# ---- defaults: edit here, or override on the command line (sbatch --nodes=4 ...) --------------
#SBATCH --job-name=vit-pretrain
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=24:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
# --ntasks-per-node = --gpus-per-node: one task per GPU. --cpus-per-task: data-loader workers + 1.
# --signal=USR1@300 (no "B:") signals the tasks themselves, which is where the trainer listens;
#   the script also forwards a USR1 it gets itself (B:USR1, or scancel --batch / --full).
# --open-mode=append keeps one log across requeues.
# -----------------------------------------------------------------------------------------------
#
# Environment variables (all optional):
#   CONFIG           run config                         (default: configs/pretrain/demo.yaml)
#   RUN_DIR          run directory; an existing checkpoint there resumes (default: runs/<job name>-<job id>)
#   OVERRIDES        extra dotted config overrides, space separated ("train.steps=1000 train.lr=3e-4")
#   PYTHON           interpreter (default: .venv/bin/python if present, else python3; "python" in a container).
#                    May hold a prefix, e.g. PYTHON="apptainer exec --nv vit.sif python".
#   CONTAINER_IMAGE  run the tasks in this image through enroot/pyxis (srun --container-image)
#   CONTAINER_MOUNTS pyxis mounts (default: the repository; add data and run dirs that live elsewhere)
#   MAX_RESTARTS     give up after this many requeues (default: 20)
#   ENTRY            the Python entry point (default: launch/pretrain.py; slurm/finetune.sh sets it)
#   EXTRA_ARGS       arguments placed before the overrides (slurm/finetune.sh uses it)
#   ELASTIC_MIN_NODES  run elastically (docs/cluster.md, Elastic): one torchrun agent per node, the
#                    rendezvous on the first node; the job goes on while at least this many nodes live.
#                    Submit with `sbatch --no-kill` so that Slurm keeps the allocation when a node fails.
#   ELASTIC_MAX_RESTARTS  worker-group restarts torchrun allows (default: 20)
#   ELASTIC_RDZV_CONF  more --rdzv-conf key=value pairs, comma separated, e.g. "last_call_timeout=10" (a
#                    round with fewer than all nodes waits that long for more; torch's default is 30 s)
#                    Both are refused without ELASTIC_MIN_NODES.
set -euo pipefail

# The trainer's exit codes this script acts on: ExitCode in pipeline/exit_codes.py (a test checks
# that these agree; docs/run-directory.md lists them all).
PREEMPTED_EXIT_CODE=75   # ExitCode.PREEMPTED: checkpointed after SIGUSR1/SIGTERM, requeue me
USAGE_EXIT_CODE=2        # ExitCode.USAGE: a config or command-line error; this script's own errors too
HUNG_EXIT_CODE=76        # ExitCode.HUNG: a rank made no progress for dist.timeout_s; not requeued

die() { echo "error: $*" >&2; exit "$USAGE_EXIT_CODE"; }

if [[ -z ${SLURM_JOB_ID:-} ]]; then
    die "run this script with sbatch (e.g. 'sbatch slurm/pretrain.sh'), not directly"
fi

# sbatch runs a copy of this script from Slurm's spool directory: the repository is where it was submitted.
cd "${SLURM_SUBMIT_DIR:?}"
ENTRY=${ENTRY:-launch/pretrain.py}
[[ -f $ENTRY ]] || die "ENTRY=$ENTRY not found in $PWD; submit from the repository root"

# DEFAULT_CONFIG: slurm/finetune.sh sets it empty (launch/finetune.py then derives the run's config).
CONFIG=${CONFIG:-${DEFAULT_CONFIG-configs/pretrain/demo.yaml}}
[[ -z $CONFIG || -f $CONFIG ]] || die "CONFIG=$CONFIG does not exist (relative paths are relative to $PWD)"
# The job id survives requeues, so the default run directory is the same on every restart.
RUN_DIR=${RUN_DIR:-runs/${SLURM_JOB_NAME:-vit}-${SLURM_JOB_ID}}
OVERRIDES=${OVERRIDES:-}
EXTRA_ARGS=${EXTRA_ARGS:-}
MAX_RESTARTS=${MAX_RESTARTS:-20}
CONTAINER_IMAGE=${CONTAINER_IMAGE:-}
RESTART_COUNT=${SLURM_RESTART_COUNT:-0}
ELASTIC_MIN_NODES=${ELASTIC_MIN_NODES:-}
# The two settings of an elastic job mean nothing without it: refuse them rather than run a fixed-size job.
for var in ELASTIC_MAX_RESTARTS ELASTIC_RDZV_CONF; do
    [[ -n $ELASTIC_MIN_NODES || -z ${!var:-} ]] \
        || die "$var=${!var} is set but ELASTIC_MIN_NODES is not: set ELASTIC_MIN_NODES to run elastically, or unset $var"
done
ELASTIC_MAX_RESTARTS=${ELASTIC_MAX_RESTARTS:-20}
ELASTIC_RDZV_CONF=${ELASTIC_RDZV_CONF:-}
NUM_NODES=${SLURM_JOB_NUM_NODES:-1}
if [[ -n $ELASTIC_MIN_NODES ]]; then
    [[ $ELASTIC_MIN_NODES =~ ^[1-9][0-9]*$ && $ELASTIC_MIN_NODES -le $NUM_NODES ]] \
        || die "ELASTIC_MIN_NODES=$ELASTIC_MIN_NODES: expected a whole number from 1 to the job's $NUM_NODES nodes"
    [[ $ELASTIC_MAX_RESTARTS =~ ^[0-9]+$ ]] || die "ELASTIC_MAX_RESTARTS=$ELASTIC_MAX_RESTARTS: expected a whole number"
    [[ -z $ELASTIC_RDZV_CONF || $ELASTIC_RDZV_CONF =~ ^[a-z_]+=[^,=]+(,[a-z_]+=[^,=]+)*$ ]] \
        || die "ELASTIC_RDZV_CONF=$ELASTIC_RDZV_CONF: expected key=value pairs separated by commas, e.g. last_call_timeout=10"
fi

if [[ -z ${PYTHON:-} ]]; then
    if [[ -n $CONTAINER_IMAGE ]]; then
        PYTHON=python
    elif [[ -x .venv/bin/python ]]; then
        PYTHON=.venv/bin/python
    else
        PYTHON=python3
    fi
fi

# ---- environment for the tasks ----------------------------------------------------------------
export PYTHONUNBUFFERED=1                                  # log lines appear as they happen
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-${SLURM_CPUS_PER_TASK:-1}}
# NCCL (GPU). Harmless on CPU, where the process group uses gloo.
#   A rank that dies makes the others fail fast with an error instead of hanging until the timeout:
export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
export NCCL_ASYNC_ERROR_HANDLING=${NCCL_ASYNC_ERROR_HANDLING:-1}   # the name before PyTorch 2.2
#   Uncomment and adapt for your fabric (ask your admins; `NCCL_DEBUG=INFO` shows what NCCL picked):
# export NCCL_DEBUG=INFO
# export NCCL_IB_HCA=mlx5                # InfiniBand adapters to use
# export NCCL_SOCKET_IFNAME=ib0          # interface for NCCL's bootstrap/socket traffic (not lo/docker0)
# export NCCL_IB_GID_INDEX=3             # RoCE
# export NCCL_NET_GDR_LEVEL=PHB          # GPUDirect RDMA distance
# MASTER_PORT: pipeline/dist.py derives it from the job id; export it here to pick one yourself.

# ---- the step ---------------------------------------------------------------------------------
read -r -a python_cmd <<<"$PYTHON"
read -r -a extra_args <<<"$EXTRA_ARGS"
read -r -a overrides <<<"$OVERRIDES"
config_args=()
[[ -z $CONFIG ]] || config_args=(--config "$CONFIG")
cmd=("${python_cmd[@]}" "$ENTRY" "${config_args[@]}" "${extra_args[@]}" "run.dir=$RUN_DIR" "${overrides[@]}")
elastic_exits=""
if [[ -n $ELASTIC_MIN_NODES ]]; then
    # One task per node: a torchrun agent that starts this node's ranks (as many as --ntasks-per-node
    # asked for) and meets the other agents at a c10d rendezvous on the first node (its store lives in
    # the agent there: losing that node ends the job; docs/cluster.md, Elastic, says what to do instead).
    procs=${SLURM_NTASKS_PER_NODE:-1}
    procs=${procs%%(*}  # "8(x2)" -> 8
    rdzv_host=$(scontrol show hostnames "${SLURM_JOB_NODELIST:?}" | head -n 1)
    # Next to the MASTER_PORT that pipeline/dist.py derives from the job id; the workers' own port is the agent's choice.
    rdzv_port=${RDZV_PORT:-$((10000 + (SLURM_JOB_ID + 1) % 20000))}
    # Each agent's exit code, by node: srun reports the highest of its tasks, and a lost node's is a kill.
    elastic_exits=logs/elastic-${SLURM_JOB_ID}
    rm -rf "$elastic_exits" && mkdir -p "$elastic_exits"
    # --rdzv-conf is_host: the first node's agent hosts the store, said outright (torch guesses from the
    # endpoint's name, and agents that share a host, or a name that resolves locally, would race for it).
    torchrun_args=(--nnodes "$ELASTIC_MIN_NODES:$NUM_NODES" --nproc-per-node "$procs" --rdzv-backend c10d
                   --rdzv-endpoint "$rdzv_host:$rdzv_port" --rdzv-id "slurm-$SLURM_JOB_ID" --rdzv-conf "__IS_HOST__${ELASTIC_RDZV_CONF:+,$ELASTIC_RDZV_CONF}"
                   --max-restarts "$ELASTIC_MAX_RESTARTS")
    # A node joining later needs it (pipeline.dist.elastic_store_warning says why).
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
    # Per task (slurm/elastic_agent.sh): __IS_HOST__ -> is_host=1 on the job's first node, 0 elsewhere; a
    # SIGUSR1 -> the agent's SIGTERM (checkpoint, exit 75); the agent's exit code to $elastic_exits/<node>.
    cmd=(slurm/elastic_agent.sh "$elastic_exits" "${python_cmd[@]}" -m torch.distributed.run "${torchrun_args[@]}"
         "$ENTRY" "${config_args[@]}" "${extra_args[@]}" "run.dir=$RUN_DIR" "${overrides[@]}")
fi

# Slurm >= 22.05 no longer passes --cpus-per-task from sbatch to srun: say it again.
# No --kill-on-bad-exit: every rank of a preempted job exits 75, and the first one's exit must not kill
# the others before they have left. A task that fails leaves its peers waiting in a collective until
# their watchdog (dist.timeout_s) ends them with 76.
srun_args=(--label "--cpus-per-task=${SLURM_CPUS_PER_TASK:-1}")
if [[ -n $ELASTIC_MIN_NODES ]]; then
    # One agent per node with the CPUs of all its ranks; --no-kill: a failed node does not end the step.
    srun_args=(--label --no-kill --kill-on-bad-exit=0 --nodes "$NUM_NODES" --ntasks "$NUM_NODES" --ntasks-per-node 1
               "--cpus-per-task=$(( ${SLURM_CPUS_PER_TASK:-1} * ${procs:-1} ))")
fi
if [[ -n $CONTAINER_IMAGE ]]; then
    srun_args+=(
        "--container-image=$CONTAINER_IMAGE"
        "--container-mounts=${CONTAINER_MOUNTS:-$PWD:$PWD}"
        "--container-workdir=$PWD"
    )
fi

echo "=== $(date -Is) job ${SLURM_JOB_ID} (${SLURM_JOB_NAME:-}) restart ${RESTART_COUNT}/${MAX_RESTARTS}"
nodes=$(scontrol show hostnames "${SLURM_JOB_NODELIST:-}" 2>/dev/null | paste -sd' ' || true)
echo "=== nodes ${nodes:-${SLURM_JOB_NODELIST:-?}} (${SLURM_JOB_NUM_NODES:-?}), world size ${SLURM_NTASKS:-?}" \
     "(${SLURM_NTASKS_PER_NODE:-?} per node)"
echo "=== run dir ${RUN_DIR}, config ${CONFIG:-(derived by $ENTRY)}${CONTAINER_IMAGE:+, container $CONTAINER_IMAGE}"
echo "=== srun ${srun_args[*]} ${cmd[*]}"

srun_pid=""
# A USR1 that reaches this shell (--signal=B:USR1@..., scancel --batch/--full) goes on to the
# tasks: srun forwards USR1 to every task of its step. SIGTERM is not forwarded: Slurm sends it to
# the tasks itself on scancel/timeout, and a SIGTERM to srun would make it SIGKILL them.
# shellcheck disable=SC2317  # trap handlers: called by the traps below
forward_usr1() {
    echo "=== $(date -Is) batch shell got SIGUSR1: forwarding to the tasks (checkpoint and requeue)"
    [[ -z $srun_pid ]] || kill -USR1 "$srun_pid" 2>/dev/null || true
}
# SIGTERM reaches this shell when the job is cancelled (scancel), hits its time limit or is
# preempted by Slurm itself; none of these may be undone by our own requeue below.
got_sigterm=0
# shellcheck disable=SC2317
note_term() {
    got_sigterm=1
    echo "=== $(date -Is) batch shell got SIGTERM (scancel/time limit): letting the tasks checkpoint, no requeue"
}
trap forward_usr1 USR1
trap note_term TERM   # set before srun starts: an untrapped USR1/TERM would end this shell

srun "${srun_args[@]}" "${cmd[@]}" &
srun_pid=$!

# `wait` returns early whenever a trapped signal arrives; wait again until srun has really exited.
while true; do
    set +e
    wait "$srun_pid"
    rc=$?
    set -e
    kill -0 "$srun_pid" 2>/dev/null || break
done
trap - USR1 TERM
if [[ -n $elastic_exits ]] && grep -qx 0 "$elastic_exits"/* 2>/dev/null; then
    # The run finished on the nodes that were left: a lost node's agent (killed) does not fail the job.
    echo "=== $(date -Is) elastic: finished on $(grep -lx 0 "$elastic_exits"/* | xargs -n1 basename | paste -sd' ')" \
         "(srun exited with $rc)"
    rc=0
fi

# srun exits with the highest exit code of its tasks.
if [[ $rc -eq 0 ]]; then
    echo "=== $(date -Is) done: ${RUN_DIR}"
    exit 0
fi
if [[ $rc -eq $HUNG_EXIT_CODE ]]; then
    echo "=== $(date -Is) a rank hung (exit $rc): its line above names the rank, step and phase; every thread's" \
         "stack is in ${RUN_DIR}/errors/hang-rank*.txt. Not requeued (it would most likely hang again)." >&2
    exit "$rc"
fi
if [[ $rc -ne $PREEMPTED_EXIT_CODE ]]; then
    echo "=== $(date -Is) failed: srun exited with $rc (not requeued)" >&2
    exit "$rc"
fi
if ((got_sigterm)); then
    echo "=== $(date -Is) checkpointed after SIGTERM: job ended, not requeued; resume with RUN_DIR=${RUN_DIR} sbatch ..." >&2
    exit "$rc"
fi
if ((RESTART_COUNT >= MAX_RESTARTS)); then
    echo "=== $(date -Is) preempted again after ${RESTART_COUNT} restarts (MAX_RESTARTS=${MAX_RESTARTS}): giving up" >&2
    exit "$rc"
fi
echo "=== $(date -Is) checkpointed after a signal: requeueing job ${SLURM_JOB_ID} to resume from ${RUN_DIR}"
if ! scontrol requeue "$SLURM_JOB_ID"; then
    echo "=== scontrol requeue ${SLURM_JOB_ID} failed; resume with RUN_DIR=${RUN_DIR} sbatch ..." >&2
    exit "$rc"
fi
exit 0
