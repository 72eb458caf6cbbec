"""Shared fixtures: a session model cache, the session's tiny CPU sweep and real SLURM clusters. Shared test code
(composing configs, running `python -m dsexp`, reading its results) is in tests/helpers/; tests import it from
there, never from this file."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from helpers.run import run_dsexp
from helpers.slurm import slurm_cluster, slurm_cluster_2nodes  # noqa: F401  (fixtures: a real SLURM cluster)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One model/reference cache for the whole session (CI sets DSEXP_CACHE to keep it across runs)."""
    env = os.environ.get("DSEXP_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("dsexp-cache")


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory, cache_dir):
    """`python -m dsexp -m tp=1,2 load=eager model=tiny`, run once per session: (cwd, sweep dir, process)."""
    cwd = tmp_path_factory.mktemp("sweep")
    proc = run_dsexp(["-m", "tp=1,2", "load=eager", "model=tiny", "hydra.sweep.dir=multirun/s"], cwd, cache_dir)
    return cwd, cwd / "multirun" / "s", proc
