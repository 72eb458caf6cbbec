"""Fit checks before launch: does what the memory model predicts per rank fit the GPU that holds it?"""

from __future__ import annotations

from typing import Any, Dict

from dsexp.predict.weights_per_rank import Prediction

GIB = 2**30
# What a rank's process holds on the device beyond its allocator before any collective: the CUDA context and the
# kernels loaded with it (NVML per process - torch reserved; 0.68 GiB on the H200 with torch 2.11 / CUDA 13, at 2, 4
# and 8 ranks sharing it alike). The fit checks add one per rank; the run itself measures it (start.outside.context).
CUDA_CONTEXT_BYTES = int(0.68 * GIB)


def shared_gpu_fit(pred: Prediction, ranks_per_node: int, gpus: int, total: int) -> Dict[str, Any]:
    """Ranks sharing GPUs (launcher.gpus): does the busiest GPU hold its ranks? Each rank's weights (as the allocator
    reserves them) and KV cache plus a CUDA context per rank, against the GPU's `total` bytes."""
    busiest = [r for r in range(ranks_per_node) if r % gpus == 0]  # GPU 0 of the first node: local ranks 0, gpus, ..
    held = sum(pred.reserve[r] + pred.kv_cache[r] for r in busiest)
    need = held + len(busiest) * CUDA_CONTEXT_BYTES
    return {
        "fits": need <= total,
        "need": need,
        "total": total,
        "ranks_on_gpu": len(busiest),
        "message": (
            f"tp={pred.tp} with launcher.gpus={gpus}: {len(busiest)} ranks share one GPU and are predicted to hold "
            f"{need / GIB:.1f} GiB there ({held / GIB:.1f} GiB of weights and KV cache from the memory model + "
            f"{len(busiest)} CUDA contexts of {CUDA_CONTEXT_BYTES / GIB:.2f} GiB), more than the GPU's "
            f"{total / GIB:.1f} GiB; use more GPUs (launcher.gpus), a larger tp's engine that splits the weights, "
            "or a smaller model"
        ),
    }
