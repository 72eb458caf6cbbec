"""Test-only fault injection: make one rank fail in a chosen way at the start of a chosen phase.

`debug=fault 'fault={rank: 1, phase: load, kind: raise|exit|sigkill|sleep|alloc_host|alloc_gpu}'`
(conf/debug/fault.yaml).
`kind: poison_buffers` is not a crash: right after from_pretrained it fills the model's non-persistent buffers with
NaN (or `value: 0`: the zeros fresh memory holds, finite but wrong, as seen on the H200), deterministically, as
transformers >= 5 leaves them uninitialised for remote code; `roles: true` makes it
fire in the tp=1 reference run too (other faults never do).
Used by the reliability tests to check that every failure becomes a recorded, classified result.
`kind: oom, at_tokens: N` raises torch.OutOfMemoryError at every workload point of batch x prompt tokens >= N, on
every rank (maybe_oom): a point that does not fit, simulated on the CPU, before the point's forward.
`kind: oom_forward, at_tokens: N` raises it inside the forward instead, on `rank` only (`rank: all`: on every rank),
from a forward pre-hook on the second decoder layer (oom_in_forward): the peers have gone through the first layer's
all_reduce and wait in the next one, as when one GPU runs out of memory alone.
`once: true` makes the fault transient: it fires on the first attempt of a job only (a marker in the
job folder remembers), so a resumed sweep shows the retried job succeeding.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path
from typing import Any, Dict, Optional

KINDS = ("raise", "exit", "sigkill", "sleep", "alloc_host", "alloc_gpu", "poison_buffers", "oom", "oom_forward")


FIRED_MARK = ".dsexp-fault-fired"


def maybe_inject(fault: Optional[Dict[str, Any]], rank: int, phase: str, job_dir: Optional[Path] = None) -> None:
    if not fault or fault.get("kind") in ("poison_buffers", "oom", "oom_forward"):  # the loader's / at points
        return
    if int(fault.get("rank", 0)) != rank or fault.get("phase", "load") != phase:
        return
    if fault.get("once") and job_dir is not None:
        mark = Path(job_dir) / FIRED_MARK
        if mark.exists():
            return
        mark.touch()
    kind = fault.get("kind")
    if kind == "raise":
        raise RuntimeError(f"dsexp fault injection: rank {rank} raised in phase {phase}")
    if kind == "exit":
        os._exit(int(fault.get("code", 3)))
    if kind == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "sleep":
        time.sleep(float(fault.get("seconds", 3600)))
    if kind == "alloc_host":
        _alloc_host(int(fault.get("cap_mb", 512)))
    if kind == "alloc_gpu":
        import torch

        torch.empty(
            int(fault.get("gib", 10_000)) * 2**30, dtype=torch.uint8, device=f"cuda:{torch.cuda.current_device()}"
        )


def poison_buffers(fault: Optional[Dict[str, Any]], rank: int, model) -> None:
    """kind=poison_buffers: NaN (or fault.value) in every floating non-persistent buffer of this rank's freshly
    loaded model."""
    if not fault or fault.get("kind") != "poison_buffers" or int(fault.get("rank", 0)) != rank:
        return
    import torch

    from dsexp.core.module_buffers import non_persistent_buffers

    with torch.no_grad():
        for _, _, _, buf in non_persistent_buffers(model):
            if buf.is_floating_point():
                buf.fill_(float(fault.get("value", "nan")))


def _alloc_host(cap_mb: int) -> None:
    """Cap this process's data segment `cap_mb` above its current size, then allocate past it."""
    import resource

    import psutil

    cap = psutil.Process().memory_info().vms + cap_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    hog = []
    while True:
        hog.append(bytearray(64 * 2**20))


def maybe_oom(fault: Optional[Dict[str, Any]], batch: int, prompt_tokens: Optional[int]) -> None:
    """kind=oom: a simulated out-of-memory error (CPU tests) at every workload point of batch x prompt tokens >=
    `at_tokens`, on every rank (AutoTP's ranks hold the same shapes: a real one hits them all)."""
    if not fault or fault.get("kind") != "oom":
        return
    need = batch * (prompt_tokens or 0)
    if need >= int(fault.get("at_tokens", 0)):
        import torch

        raise torch.OutOfMemoryError(f"dsexp fault injection: out of memory at batch {batch} x {prompt_tokens} tokens")


@contextlib.contextmanager
def oom_in_forward(fault: Optional[Dict[str, Any]], rank: int, module, point):
    """kind=oom_forward: while a workload point of batch x prompt tokens >= `at_tokens` runs, the second decoder
    layer's forward raises torch.OutOfMemoryError on `rank` (or on every rank: `rank: all`)."""
    if not _fires_in_forward(fault, rank, point):
        yield
        return
    import torch

    def raise_oom(layer, args):
        raise torch.OutOfMemoryError(
            f"dsexp fault injection: rank {rank} out of memory in the forward at batch {point.batch} x "
            f"{point.prompt_tokens} tokens"
        )

    handle = _decoder_layers(module)[1].register_forward_pre_hook(raise_oom)
    try:
        yield
    finally:
        handle.remove()


def _fires_in_forward(fault: Optional[Dict[str, Any]], rank: int, point) -> bool:
    if not fault or fault.get("kind") != "oom_forward" or fault.get("rank", 0) not in ("all", rank):
        return False
    return point.batch * (point.prompt_tokens or 0) >= int(fault.get("at_tokens", 0))


def _decoder_layers(module):
    """The model's decoder layers: its first ModuleList of two or more modules."""
    import torch

    for sub in module.modules():
        if isinstance(sub, torch.nn.ModuleList) and len(sub) >= 2:
            return sub
    raise RuntimeError("fault oom_forward: the model has no ModuleList of two or more layers to raise in")
