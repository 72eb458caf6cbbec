"""What a rank does once it has started: one workload per run, named by the job (`runtime["workload"]`).

pipeline   dsexp's own measured run: load -> engine -> generate, each a phase (dsexp.rank.workloads.pipeline)
reference  the tp=1 eager run whose first-step logits the measured runs are checked against
split      load=sharded's one-off split: the engine places the model, each rank saves its slice
script     a user's own script, run as written; its phases come from hooks on the library calls it makes

The worker (dsexp.rank.worker) starts a rank, joins the process group and hands the workload's `run(ctx, rec)` a
PhaseRecorder. A script starts its ranks itself: dsexp.rank.bootstrap reaches them and installs the script
workload's hooks.
"""

from __future__ import annotations

import importlib
from types import ModuleType

WORKLOADS = {"pipeline": "pipeline", "reference": "reference", "split": "save_split", "script": "script"}  # -> module


def get_workload(name: str) -> ModuleType:
    if name not in WORKLOADS:
        raise KeyError(f"workload {name!r} is not implemented; available: {', '.join(WORKLOADS)}")
    return importlib.import_module(f"{__name__}.{WORKLOADS[name]}")
