#!/usr/bin/env bash
# Multi-node ViT fine-tuning from a pretrained run at a new resolution (position embeddings are
# resized, the head is replaced). Same launch, requeue and container handling as
# slurm/pretrain.sh, which this script runs after setting the fine-tune defaults.
#
#   RES=384 sbatch slurm/finetune.sh          # the newest finished pretraining run in runs/, paper recipe
#   FROM=runs/vit-pretrain-1234 RES=384 sbatch slurm/finetune.sh
#   FROM=runs/b16 RES=384 CONFIG=configs/finetune/vit_b16_384.yaml RUN_DIR=runs/b16-384 sbatch slurm/finetune.sh
#
# ---- defaults: edit here, or override on the command line ----------------------------------
#SBATCH --job-name=vit-finetune
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=8
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=12
#SBATCH --time=12:00:00
#SBATCH --signal=USR1@300
#SBATCH --requeue
#SBATCH --open-mode=append
#SBATCH --output=logs/%x-%j.out
# See slurm/pretrain.sh for what each line is for.
# ---------------------------------------------------------------------------------------------
#
# Environment variables (besides those of slurm/pretrain.sh: RUN_DIR, OVERRIDES, PYTHON,
# CONTAINER_IMAGE, CONTAINER_MOUNTS, MAX_RESTARTS):
#   FROM    weights to start from: a pretrain run directory, a .safetensors file or a timm .pth/.bin
#           (default: the newest finished pretraining run in runs/, named in the log)
#   RES     fine-tuning resolution, e.g. 384 or 384x512 (default: the config's model.img_size)
#   CONFIG  fine-tune config (default: none: the paper's recipe, configs/finetune/vit_b16_384.yaml's
#           train section, with the architecture and data set of the FROM run; see launch/finetune.py)
#   RUN_DIR default: runs/<job name>-<job id>
set -euo pipefail

USAGE_EXIT_CODE=2  # ExitCode.USAGE (pipeline/exit_codes.py), as in slurm/pretrain.sh
die() { echo "error: $*" >&2; exit "$USAGE_EXIT_CODE"; }

if [[ -z ${SLURM_JOB_ID:-} ]]; then
    die "run this script with sbatch (e.g. 'RES=384 sbatch slurm/finetune.sh'), not directly"
fi
cd "${SLURM_SUBMIT_DIR:?}"

FROM=${FROM:-}
RES=${RES:-}
[[ -z $FROM || -e $FROM ]] || die "FROM=$FROM does not exist (relative paths are relative to $PWD)"
[[ -z $RES || $RES =~ ^[0-9]+(x[0-9]+)?$ ]] || die "RES=$RES: expected a size like 384 or 384x512"

export ENTRY=${ENTRY:-launch/finetune.py}
export DEFAULT_CONFIG=""   # no CONFIG: launch/finetune.py derives the config from the FROM run
EXTRA_ARGS="${FROM:+--from $FROM}${RES:+ --res $RES}${EXTRA_ARGS:+ $EXTRA_ARGS}"
export EXTRA_ARGS

# Everything else (checks, environment, srun, signal forwarding, requeue on exit 75) is shared.
# A requeued job reruns this script, so FROM and RES stay the same and RUN_DIR resumes; without FROM,
# launch/finetune.py takes the source RUN_DIR recorded at the first start (not the newest run again).
source slurm/pretrain.sh
