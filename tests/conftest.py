"""Shared fixtures: a session model cache, the session's tiny CPU sweep and real SLURM clusters. Shared test code
(composing configs, running `python -m dsexp`, reading its results) is in tests/helpers/; tests import it from
there, never from this file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from filelock import FileLock

from helpers.run import run_dsexp
from helpers.slurm import slurm_cluster, slurm_cluster_2nodes  # noqa: F401  (fixtures: a real SLURM cluster)


@pytest.fixture(scope="session", autouse=True)
def torch_extensions_of_this_environment():
    """DeepSpeed JIT-builds its CPU ops on the ranks (the shared-memory all-reduce: a minute of compiling) under
    TORCH_EXTENSIONS_DIR, by default one folder per user. Its build file names the environment's paths, so checkouts
    with their own .venv (worktrees, clones) sharing a machine rebuild it in turn, each after the other built it. The
    tests' ranks get a folder of this environment's own, kept across runs, unless TORCH_EXTENSIONS_DIR is set; the
    variable is removed again at the session's end."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        yield
        return
    key = hashlib.sha1(sys.prefix.encode()).hexdigest()[:12]
    os.environ["TORCH_EXTENSIONS_DIR"] = str(Path.home() / ".cache" / "torch_extensions" / f"dsexp-{key}")
    try:
        yield
    finally:
        os.environ.pop("TORCH_EXTENSIONS_DIR", None)


def session_dir(tmp_path_factory) -> Path:
    """The session's temporary folder, one for all of pytest-xdist's workers (each has its own below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One model/reference cache for the whole session, its workers included (CI sets DSEXP_CACHE to keep it across
    runs); dsexp's cache takes concurrent writers."""
    env = os.environ.get("DSEXP_CACHE")
    path = Path(env) if env else session_dir(tmp_path_factory) / "dsexp-cache"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory, cache_dir):
    """`python -m dsexp -m tp=1,2 load=eager model=tiny`, run once per session, whichever worker asks first (the others
    wait for it and read it; tests only read it): (cwd, sweep dir, process)."""
    shared = session_dir(tmp_path_factory)
    cwd, done = shared / "tiny-sweep", shared / "tiny-sweep.json"
    with FileLock(str(shared / "tiny-sweep.lock")):
        if not done.exists():
            cwd.mkdir()
            proc = run_dsexp(["-m", "tp=1,2", "load=eager", "model=tiny", "hydra.sweep.dir=multirun/s"], cwd, cache_dir)
            done.write_text(json.dumps({k: getattr(proc, k) for k in ("args", "returncode", "stdout", "stderr")}))
    return cwd, cwd / "multirun" / "s", subprocess.CompletedProcess(**json.loads(done.read_text()))
