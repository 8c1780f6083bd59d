#!/usr/bin/env bash
# Installs Slurm (slurmctld, slurmd, sbatch) and munge from the distribution's packages,
# for the tests that run a one-host Slurm cluster (tests/cluster/test_slurm.py). Where that
# cannot be done (not root, no apt-get), says so in one line and succeeds: those tests are
# then skipped with the same reason.
set -euo pipefail
if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
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
fi
