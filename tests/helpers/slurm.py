"""pytest fixtures for a real SLURM cluster on this machine, started through tests/helpers/slurm_cluster.py.

    def test_something(slurm_cluster):
        job = slurm_cluster.sbatch("--wrap", "hostname")
        assert slurm_cluster.wait_final(job)["JobState"] == "COMPLETED"

`slurm_cluster` (session scope) is one node, `slurm_cluster_2nodes` two slurmd on this machine. Both
skip, with the reason, where SLURM/munge are not installed (.ci/install-slurm.sh installs them) or the
tests do not run as root; they stop exactly the daemons they started and remove their folder at the end.
tests/conftest.py imports both, so every test module sees them; mark such tests `slurm` (CI runs
`python -m pytest -m slurm` after `make test`). Clients reach the cluster only through `cluster.env`
(SLURM_CONF, and PATH for the sacct shim): pass it to subprocesses, or monkeypatch os.environ with
`cluster.env_vars` for code that calls sbatch itself.
"""

from __future__ import annotations

import os
import sys
from typing import Iterator, Optional

import pytest

from helpers import slurm_cluster as sc


def skip_reason() -> Optional[str]:
    """Why a real cluster cannot run here, or None."""
    if sys.platform != "linux":
        return "SLURM test cluster: Linux only"
    missing = sc.missing_binaries()
    if missing:
        return f"SLURM test cluster: {' '.join(missing)} not installed (run .ci/install-slurm.sh as root)"
    if os.geteuid() != 0:
        return "SLURM test cluster: needs root (slurmd runs jobs as their user; CI runs the tests as root)"
    return None


def start(tmp_path_factory, nodes: int):
    """Start a cluster in a fresh temp folder. The port is DSEXP_SLURM_PORT or the script's default; when
    that is taken (a `make slurm-up` cluster, another session) the next free slot of 100 ports is used."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    base = int(os.environ.get("DSEXP_SLURM_PORT", sc.DEFAULT_PORT))
    errors = []
    for port in range(base, base + 1000, 100):
        if any(sc._port_taken(p) for p in range(port, port + 1 + nodes)):
            errors.append(f"{port}: taken")
            continue
        try:
            return sc.start_cluster(tmp_path_factory.mktemp(f"slurm{nodes}n"), nodes=nodes, port=port)
        except sc.ClusterError as e:
            if "already in use" not in str(e):
                raise  # a real failure: the message carries the daemons' logs
            errors.append(f"{port}: {e}")
    raise sc.ClusterError(f"no free ports for a SLURM test cluster: {errors}")


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory) -> Iterator["sc.Cluster"]:
    """A one-node SLURM cluster (munged, slurmctld, slurmd n1) for the whole session."""
    cluster = start(tmp_path_factory, nodes=1)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def slurm_cluster_2nodes(tmp_path_factory) -> Iterator["sc.Cluster"]:
    """Two nodes (n1, n2: two slurmd on this machine, each with all of its CPUs and memory)."""
    cluster = start(tmp_path_factory, nodes=2)
    try:
        yield cluster
    finally:
        cluster.stop()
