"""Ranks that share GPUs (`launcher.gpus` below the ranks on a node): what changes inside each rank.

NCCL refuses two ranks on one device ("Duplicate GPU detected"); gloo carries all_reduce, all_gather and
all_gather_into_tensor on CUDA tensors between processes on one GPU, and each process's allocator and NVML
per-process figure stay its own. So, in every rank and before CUDA is first used:
- the rank sees only the GPU it shares (CUDA_VISIBLE_DEVICES: the job's list, round-robin by local rank), as
  cuda:0, and LOCAL_RANK (and a `--local_rank=N` argument) says 0, so the rank's own code, DeepSpeed's and
  transformers' `set_device(local_rank)` all land there; the real local rank stays in DSEXP_LOCAL_RANK;
- every process group that DeepSpeed, transformers or the rank's code creates is gloo, whatever backend it asks
  for: the one place every group is made (torch's `_new_process_group_helper`) is wrapped.
Standard library and dsexp.core only at import: the bootstrap of a user's script imports it before anything else.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import List, MutableMapping, Optional

from dsexp.core.protocol import SHARED_GPUS_ENV as SHARED_ENV

LOCAL_RANK_ENV = "DSEXP_LOCAL_RANK"  # the rank's local rank before LOCAL_RANK was rewritten


def gpu_for(local_rank: int, pool: List[str]) -> str:
    """Round-robin: local rank r uses the (r mod len(pool))-th shared GPU."""
    return pool[local_rank % len(pool)]


def map_rank(env: MutableMapping[str, str] = os.environ, argv: Optional[List[str]] = None) -> Optional[dict]:
    """In a rank, before CUDA is used: show it only its GPU and make its local rank 0 (environment and a
    `--local_rank=N` argument in argv). Returns what was done (None when the job shares no GPU). Idempotent."""
    pool = [g for g in (env.get(SHARED_ENV) or "").split(",") if g]
    if not pool:
        return None
    if LOCAL_RANK_ENV not in env:
        env[LOCAL_RANK_ENV] = env.get("LOCAL_RANK", "0")
    local = int(env[LOCAL_RANK_ENV])
    gpu = gpu_for(local, pool)
    env["CUDA_VISIBLE_DEVICES"] = gpu
    env["LOCAL_RANK"] = "0"
    if argv is not None:
        argv[:] = [_local_rank_zero(a) for a in argv]
    return {"gpu": gpu, "local_rank": local, "shared_by": pool, "backend": "gloo"}


def _local_rank_zero(arg: str) -> str:
    return "--local_rank=0" if arg.startswith("--local_rank=") or arg.startswith("--local-rank=") else arg


def force_gloo() -> None:
    """Every process group made from now on is gloo (torch must be importable). Idempotent."""
    from torch.distributed import distributed_c10d as c10d

    helper = c10d._new_process_group_helper
    if getattr(helper, "_dsexp_gloo", False):
        return

    @functools.wraps(helper)
    def gloo_only(*args, **kwargs):
        args = list(args)
        if len(args) > 3:
            args[3] = c10d.Backend("gloo")
        else:
            kwargs["backend"] = c10d.Backend("gloo")
        # NCCL's options object and a bound device (NCCL's eager init, comm splits) have no meaning for gloo
        for i, name in ((6, "backend_options"), (9, "device_id")):
            if len(args) > i:
                args[i] = None
            kwargs.pop(name, None)
        return helper(*args, **kwargs)

    gloo_only._dsexp_gloo = True
    c10d._new_process_group_helper = gloo_only


def setup_rank(argv: Optional[List[str]] = None) -> Optional[dict]:
    """Both steps in a rank of a shared-GPU job (no-op otherwise): map it to its GPU; force gloo once torch is
    imported (now if it already is)."""
    done = map_rank(os.environ, argv)
    if done is not None and "torch" in sys.modules:
        force_gloo()
    return done
