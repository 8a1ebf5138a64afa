#!/usr/bin/env bash
# Make sure Slurm and munge are installed, so the tests in tests/cluster/ can start a real local
# cluster (slurmctld + two slurmd "nodes" on loopback). Called by `make test` before pytest.
#
# Idempotent and fast (no apt call) when everything is there. Without root and without Slurm it
# prints a notice and succeeds: the Slurm tests then skip (or fail, with VIT_PIPELINE_REQUIRE_SLURM=1).
set -euo pipefail

needed=(slurmctld slurmd munged sbatch srun scontrol sinfo)
missing=()
for cmd in "${needed[@]}"; do
    # Debian puts the daemons in /usr/sbin, which a non-login shell may not have on PATH.
    command -v "$cmd" >/dev/null 2>&1 || [[ -x /usr/sbin/$cmd ]] || missing+=("$cmd")
done

if [[ ${#missing[@]} -eq 0 ]]; then
    exit 0
fi

if [[ $(id -u) -ne 0 ]]; then
    echo "install_slurm.sh: missing ${missing[*]} and not root; the Slurm tests will skip." >&2
    echo "  To run them: sudo apt-get install -y slurm-wlm munge" >&2
    exit 0
fi

if ! command -v apt-get >/dev/null 2>&1; then
    echo "install_slurm.sh: missing ${missing[*]} and no apt-get here; install Slurm and munge yourself." >&2
    exit 0
fi

echo "install_slurm.sh: installing slurm-wlm and munge (missing: ${missing[*]})" >&2
export DEBIAN_FRONTEND=noninteractive
if ! { apt-get update -q && apt-get install -y -q --no-install-recommends slurm-wlm munge; }; then
    echo "install_slurm.sh: apt-get could not install slurm-wlm munge; the Slurm tests will skip." >&2
    # CI must not quietly lose the cluster tests.
    [[ ${VIT_PIPELINE_REQUIRE_SLURM:-0} == 0 ]] || exit 1
fi
