#!/usr/bin/env bash
# Make sure Slurm and munge are installed, so the tests in tests/cluster/ can start a real local
# cluster (slurmctld + two slurmd "nodes" on loopback). Called by `make test` before pytest; see
# tests/apt_install.sh (skips without root, fails with VIT_PIPELINE_REQUIRE_SLURM=1 if apt fails).
set -euo pipefail
exec bash "$(dirname "$0")/../apt_install.sh" install_slurm.sh VIT_PIPELINE_REQUIRE_SLURM "the Slurm tests" \
    "slurmctld slurmd munged sbatch srun scontrol sinfo" slurm-wlm munge
