"""`launcher.pack=true`: jobs of a sweep that run at the same time each get GPUs of their own.

Hydra's launcher decides what runs at once (`hydra/launcher=dsexp_local` starts every job of the sweep
in its own process; the basic launcher runs one at a time, so nothing overlaps). Each job then claims
`tp` GPUs here before it prepares anything, waiting while too few are free, and runs with
CUDA_VISIBLE_DEVICES set to them: its checkpoint writer, reference and split runs and its ranks all
inherit that, so no two jobs share a device and per-GPU figures are the job's own. The job's CPU
affinity is narrowed to its share of the host's CPUs (the slice matching its GPUs' places in the
pool), so packed jobs' thread pools (OMP_NUM_THREADS follows the affinity) do not oversubscribe it.

The pool is fixed when the sweep starts (`init_pool`, from the sweep process: DSEXP_FAKE_GPUS=n for
tests on CPU, else its CUDA_VISIBLE_DEVICES, else every GPU NVML sees) and kept with the claims in
`<sweep>/.dsexp/gpus.json`; a file lock beside it serialises every change. Node-wide host figures are
not per job: on release a job learns which jobs held a claim during its own, and records them
(`result["packed"]["overlapped_with"]`) so the analysis does not read a shared figure as the job's.
A claim whose process is gone (a killed job) is dropped by the next job that looks.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional

import psutil
from filelock import FileLock

from dsexp.core.fs import read_json, write_json_atomic

FAKE_ENV = "DSEXP_FAKE_GPUS"
STATE = Path(".dsexp") / "gpus.json"


def gpu_pool() -> List[str]:
    """The GPUs this process may hand out, as CUDA_VISIBLE_DEVICES entries."""
    if os.environ.get(FAKE_ENV):
        return [str(i) for i in range(int(os.environ[FAKE_ENV]))]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [v.strip() for v in visible.split(",") if v.strip() not in ("", "-1")]
    from dsexp.job.devices import visible_gpus

    return [str(i) for i in range(visible_gpus())]


@contextlib.contextmanager
def _state(sweep_dir: Path) -> Iterator[Dict[str, Any]]:
    """The sweep's pool and claims, read and written back under the lock."""
    path = Path(sweep_dir) / STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        state = read_json(path) or {"pool": None, "claims": {}, "done": []}
        yield state
        write_json_atomic(path, state)


def init_pool(sweep_dir: Path) -> List[str]:
    """Fix the sweep's pool (GPUs and CPUs) from this (the sweep) process; a resumed sweep keeps its history."""
    with _state(sweep_dir) as state:
        _fix_pool(state)
        return state["pool"]


def _fix_pool(state: Dict[str, Any]) -> None:
    state["pool"], state["cpus"] = gpu_pool(), sorted(os.sched_getaffinity(0))


def cpu_share(cpus: List[int], pool: List[str], gpus: List[str]) -> List[int]:
    """The CPUs that go with these GPUs: slice i of len(pool) equal slices of the host's CPUs for pool[i]."""
    n = len(pool)
    share = []
    for g in gpus:
        i = pool.index(g)
        share += cpus[i * len(cpus) // n : (i + 1) * len(cpus) // n] or [cpus[i % len(cpus)]]
    return sorted(set(share))


def _drop_dead(state: Dict[str, Any]) -> None:
    host = socket.gethostname()
    for job, c in list(state["claims"].items()):
        if c["host"] == host and not psutil.pid_exists(c["pid"]):
            state["done"].append({"job": job, "gpus": c["gpus"], "since": c["since"], "until": time.time()})
            del state["claims"][job]


def _try_claim(sweep_dir: Path, job: str, n: int) -> Optional[Dict[str, Any]]:
    with _state(sweep_dir) as state:
        if state.get("pool") is None:  # not started through the sweep callback: this process decides
            _fix_pool(state)
        pool = state["pool"]
        if pool and n > len(pool):
            raise RuntimeError(
                f"launcher.pack=true: the job needs {n} GPUs but the sweep's pool has {len(pool)} ({','.join(pool)})"
            )
        _drop_dead(state)
        taken = {g for c in state["claims"].values() for g in c["gpus"]}
        free = [g for g in pool if g not in taken]
        if pool and len(free) < n:
            return None
        mine = {
            "gpus": free[:n] if pool else [],
            "pid": os.getpid(),
            "host": socket.gethostname(),
            "since": time.time(),
        }
        state["claims"][job] = mine
        return {**mine, "pool": pool, "cpus": cpu_share(state["cpus"], pool, mine["gpus"]) if pool else None}


def _release(sweep_dir: Path, job: str) -> List[str]:
    """Give the claim back; return the jobs whose claims overlapped it in time."""
    with _state(sweep_dir) as state:
        mine = state["claims"].pop(job)
        now = time.time()
        others = [j for j in state["claims"]] + [d["job"] for d in state["done"] if d["until"] > mine["since"]]
        state["done"].append({"job": job, "gpus": mine["gpus"], "since": mine["since"], "until": now})
        return sorted(set(others) - {job})


@contextlib.contextmanager
def claim(sweep_dir: Path, job_dir: Path, n: int, poll_s: float = 0.5) -> Iterator[Dict[str, Any]]:
    """Hold n GPUs of the sweep's pool (none on a machine without GPUs) with CUDA_VISIBLE_DEVICES set to them.

    Yields the job's `packed` record: gpus, pool, cpus, waited_s; `overlapped_with` is filled on release."""
    job = Path(job_dir).name
    t0 = time.time()
    got = _try_claim(sweep_dir, job, n)
    while got is None:
        time.sleep(poll_s)
        got = _try_claim(sweep_dir, job, n)
    packed = {
        "gpus": ",".join(got["gpus"]) or None,
        "pool": got["pool"],
        "cpus": got["cpus"],
        "waited_s": round(got["since"] - t0, 3),
        "since": got["since"],
        "until": None,
        "overlapped_with": [],
    }
    saved, affinity = os.environ.get("CUDA_VISIBLE_DEVICES"), os.sched_getaffinity(0)
    if packed["gpus"]:
        os.environ["CUDA_VISIBLE_DEVICES"] = packed["gpus"]
        os.sched_setaffinity(0, packed["cpus"])
    try:
        yield packed
    finally:
        os.sched_setaffinity(0, affinity)
        if saved is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES", None)
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = saved
        packed["overlapped_with"] = _release(sweep_dir, job)
        packed["until"] = time.time()


def gpu_indices(packed: Optional[Dict[str, Any]]) -> Optional[List[int]]:
    """NVML indices of a job's claimed GPUs (CUDA numbers them the same on a machine of one GPU model; None if
    the pool came from a CUDA_VISIBLE_DEVICES of UUIDs)."""
    gpus = (packed or {}).get("gpus")
    if not gpus or not all(g.isdigit() for g in gpus.split(",")):
        return None
    return [int(g) for g in gpus.split(",")]


def node_shared(result: Dict[str, Any]) -> bool:
    """True if other jobs of the sweep ran while this one did: its node-wide figures are not its own."""
    return bool((result.get("packed") or {}).get("overlapped_with"))
