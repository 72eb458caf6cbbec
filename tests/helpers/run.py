"""Compose configs as the app composes them, run `python -m dsexp` as a user would, and read what it wrote.

    from helpers.run import CONF, ROOT, compose, run_dsexp, spec_of, sweep_results

Fixtures (a session model cache, the session's tiny sweep, real SLURM clusters) are in tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
CONF = ROOT / "conf"


# Compositions of conf/ already made in this process, by their overrides (without the `hydra` node, whose runtime
# part names the current folder): the same overrides composed again are a copy of the first (~3 ms, where Hydra
# takes ~0.1 s reading conf/ again; the tests compose the default and each preset many times). conf/ does not change
# during a session, and the values that read the environment (cache_dir) are kept as interpolations, so the copy is
# what Hydra would give; a composition that fails is never kept, so it fails again.
_COMPOSED: Dict[Tuple[str, ...], Any] = {}


def compose(overrides: List[str] = (), hydra: bool = False):
    """The composed DictConfig for these overrides (with the `hydra` node if asked), nothing run."""
    import copy

    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    import dsexp.compose.config  # noqa: F401  (importing it registers the schema with Hydra)

    key = tuple(overrides)
    if not hydra and key in _COMPOSED:
        return copy.deepcopy(_COMPOSED[key])
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = hcompose("config", overrides=list(overrides), return_hydra_config=hydra)
    if not hydra:
        _COMPOSED[key] = copy.deepcopy(cfg)
    return cfg


def spec_of(*overrides: str, gpus: int = 0):
    """The validated JobConfig for these overrides, as a job on a machine with `gpus` GPUs would run it."""
    from dsexp.compose.config import to_schema
    from dsexp.compose.validate import validate

    return validate(to_schema(compose(list(overrides))), gpus=gpus)


def run_dsexp(
    args: List[str], cwd: Path, cache: Path, timeout: float = 900, check: bool = True, extra_env: dict = None
) -> subprocess.CompletedProcess:
    """`python -m dsexp ARGS` in `cwd` with the model cache `cache`; raises with its output tails unless it
    succeeds (check=False: the process, whatever its exit status)."""
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
    """Every job's result.json of a sweep folder, in job order."""
    return [json.loads(p.read_text()) for p in sorted(Path(sweep_dir).glob("*/result.json"))]
