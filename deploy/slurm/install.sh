#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, sbatch, srun) and munge from the distribution's
# packages, for the tests that run a one-host Slurm cluster (tests/cluster/test_slurm.py).
# They need only the programs: each test cluster writes its own slurm.conf and munge key
# in its own directory, so nothing under /etc is configured and no service is started.
# Where it cannot be done (not root, no apt-get, the install fails), says so in one line
# and succeeds: those tests are then skipped with the same reason.
set -euo pipefail
PROGRAMS=(munged slurmctld slurmd sbatch srun squeue scancel scontrol sinfo)

missing() {
    local name
    for name in "${PROGRAMS[@]}"; do
        command -v "$name" >/dev/null || echo "$name"
    done
}

if [ -z "$(missing)" ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
    echo "slurm: not installed (needs root and apt-get); the Slurm tests will be skipped"
    exit 0
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq >/dev/null || echo "slurm: apt-get update failed; trying the package lists already here"
if ! apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null; then
    echo "slurm: apt-get install slurm-wlm munge failed; the Slurm tests will be skipped"
    exit 0
fi
still=$(missing | tr '\n' ' ')
if [ -n "$still" ]; then
    echo "slurm: installed slurm-wlm and munge, but not found on PATH: ${still% }; the Slurm tests will be skipped"
else
    echo "slurm: installed $(slurmctld -V) and $(munged -V 2>&1 | head -n1)"
fi
