"""Shared fixtures: composed configs (as the app composes them) and real CPU runs of `python -m dsexp`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import List

import pytest

from helpers.slurm import slurm_cluster, slurm_cluster_2nodes  # noqa: F401  (fixtures: a real SLURM cluster)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


def compose(overrides: List[str] = (), hydra: bool = False):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return hcompose("config", overrides=list(overrides), return_hydra_config=hydra)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """One model/reference cache for the whole session (CI sets DSEXP_CACHE to keep it across runs)."""
    env = os.environ.get("DSEXP_CACHE")
    return Path(env) if env else tmp_path_factory.mktemp("dsexp-cache")


def run_dsexp(
    args: List[str], cwd: Path, cache: Path, timeout: float = 900, check: bool = True, extra_env: dict = None
) -> subprocess.CompletedProcess:
    env = {**os.environ, "DSEXP_CACHE": str(cache), "PYTHONUNBUFFERED": "1", **(extra_env or {})}
    env.pop("MLFLOW_TRACKING_URI", None)
    proc = subprocess.run(
        [sys.executable, "-m", "dsexp", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"dsexp {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
        )
    return proc


def sweep_results(sweep_dir: Path) -> List[dict]:
    return [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob("*/result.json"))]


@pytest.fixture(scope="session")
def tiny_sweep(tmp_path_factory, cache_dir):
    """`python -m dsexp -m tp=1,2 load=eager model=tiny`, run once per session: (cwd, sweep dir, process)."""
    cwd = tmp_path_factory.mktemp("sweep")
    proc = run_dsexp(["-m", "tp=1,2", "load=eager", "model=tiny", "hydra.sweep.dir=multirun/s"], cwd, cache_dir)
    return cwd, cwd / "multirun" / "s", proc
