#!/usr/bin/env bash
# CI: install Debian's SLURM (slurmctld, slurmd, clients) and munge, quietly and only if missing.
# Idempotent: a second call with everything present does nothing (no apt-get update either).
# The test fixture (tests/helpers/slurm.py via tests/helpers/slurm_cluster.py) starts its own daemons from
# a temp folder, so the packaged services must not be started here: a policy-rc.d that refuses
# service starts is put in place for the install (unless one already exists) and removed afterwards.
set -euo pipefail

need=()
for bin in munged:munge slurmctld:slurmctld slurmd:slurmd sbatch:slurm-client; do
    command -v "${bin%%:*}" >/dev/null 2>&1 || [[ -x /usr/sbin/${bin%%:*} ]] || need+=("${bin##*:}")
done
if [[ ${#need[@]} -eq 0 ]]; then
    echo "install-slurm: slurm-wlm and munge already installed" >&2
    exit 0
fi
if [[ $(id -u) -ne 0 ]]; then
    echo "install-slurm: missing ${need[*]} and not root: run as root (or install slurm-wlm munge yourself)" >&2
    exit 1
fi

policy=/usr/sbin/policy-rc.d
made_policy=
if [[ ! -e $policy ]]; then
    printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
fi
cleanup() { [[ -n $made_policy ]] && rm -f "$policy"; return 0; }
trap cleanup EXIT

export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq --no-install-recommends slurm-wlm munge >/dev/null
echo "install-slurm: installed slurm-wlm $(dpkg-query -W -f='${Version}' slurm-wlm) and munge $(dpkg-query -W -f='${Version}' munge)" >&2
