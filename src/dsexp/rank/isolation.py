"""Keep the job side's packages out of a rank.

A rank needs none of Hydra, OmegaConf, MLflow, pandas or matplotlib, and in a software stack (`stack=`) the job
environment's builds of them may not even import (pandas built for numpy 2 under a stack's numpy 1.26). Yet
DeepSpeed imports MLflow whenever it can (`deepspeed/autotuning/autotuner.py`: `try: import mlflow`), and MLflow
imports pandas. So the worker hides them before it imports anything heavy: the path finder reports them as not
installed, for `import` and for availability checks (`importlib.util.find_spec`) alike.
"""

from __future__ import annotations

import importlib.machinery
import sys

JOB_SIDE = frozenset({"hydra", "omegaconf", "mlflow", "mlflow_skinny", "pandas", "matplotlib", "hydra_plugins"})


class _PathFinderWithoutJobSide(importlib.machinery.PathFinder):
    @classmethod
    def find_spec(cls, fullname, path=None, target=None):
        if fullname.partition(".")[0] in JOB_SIDE:
            return None
        return super().find_spec(fullname, path, target)


def hide_job_side_packages() -> None:
    """Replace the standard path finder in sys.meta_path (idempotent)."""
    sys.meta_path[:] = [_PathFinderWithoutJobSide if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
