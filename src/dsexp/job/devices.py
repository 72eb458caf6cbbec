"""The GPUs this process may use: what validation checks `tp` against and what packing hands out."""

from __future__ import annotations

import os


def visible_gpus() -> int:
    """GPUs this process may use (NVML, narrowed by CUDA_VISIBLE_DEVICES); 0 without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception:
        return 0
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        n = min(n, len([v for v in vis.split(",") if v.strip() not in ("", "-1")]))
    return n


def gpu_capability():
    """(major, minor) compute capability of the first visible GPU (NVML); None without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        index = int(first) if first.isdigit() else 0
        cap = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(pynvml.nvmlDeviceGetHandleByIndex(index)))
        pynvml.nvmlShutdown()
        return cap
    except Exception:
        return None
