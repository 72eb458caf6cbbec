"""GPU memory of this rank's device: torch's allocator view and NVML's view (context, NCCL, raw cudaMalloc).

NVML indexes physical devices and ignores CUDA_VISIBLE_DEVICES, so the handle is found by the
device UUID torch reports. NVML's per-process figure needs PIDs that match ours; where they don't
(containers), it is recorded as None rather than guessed.
"""

from __future__ import annotations

import os
import subprocess
from typing import Dict, Optional


class NvmlDevice:
    """NVML handle of one CUDA device, or an inert stand-in when NVML is unavailable."""

    def __init__(self, torch_index: Optional[int]):
        self.handle = None
        self.uuid = None
        if torch_index is None:
            return
        try:
            import pynvml
            import torch

            pynvml.nvmlInit()
            want = str(torch.cuda.get_device_properties(torch_index).uuid)
            for i in range(pynvml.nvmlDeviceGetCount()):
                h = pynvml.nvmlDeviceGetHandleByIndex(i)
                uuid = pynvml.nvmlDeviceGetUUID(h)
                uuid = uuid.decode() if isinstance(uuid, bytes) else uuid
                if want in uuid:
                    self.handle, self.uuid = h, uuid
                    break
        except Exception:
            self.handle = None

    def used(self) -> Optional[int]:
        if self.handle is None:
            return None
        import pynvml

        return int(pynvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_used(self, pid: Optional[int] = None) -> Optional[int]:
        if self.handle is None:
            return None
        import pynvml

        pid = pid or os.getpid()
        try:
            procs = pynvml.nvmlDeviceGetComputeRunningProcesses(self.handle)
        except pynvml.NVMLError:
            return None
        for p in procs:
            if p.pid == pid and p.usedGpuMemory is not None:
                return int(p.usedGpuMemory)
        return None


def torch_snapshot(device_index: int) -> Dict[str, int]:
    """Allocator figures for the phase just ended (peaks since the last reset) and the driver's free/total."""
    import torch

    torch.cuda.synchronize(device_index)
    free, total = torch.cuda.mem_get_info(device_index)
    return {
        "gpu_alloc": torch.cuda.memory_allocated(device_index),
        "gpu_reserved": torch.cuda.memory_reserved(device_index),
        "gpu_alloc_peak": torch.cuda.max_memory_allocated(device_index),
        "gpu_reserved_peak": torch.cuda.max_memory_reserved(device_index),
        "gpu_driver_used": total - free,
        "gpu_total": total,
    }


def outside_reading(device_index: int, nvml: NvmlDevice) -> Dict[str, Optional[int]]:
    """This process's device memory outside PyTorch's allocator now: NVML process used - torch reserved (None
    where NVML cannot see our PID). The synchronize creates the CUDA context if nothing has yet."""
    import torch

    torch.cuda.synchronize(device_index)
    proc, reserved = nvml.process_used(), torch.cuda.memory_reserved(device_index)
    return {
        "nvml_process_used": proc,
        "nvml_device_used": nvml.used(),
        "gpu_reserved": reserved,
        "gpu_alloc": torch.cuda.memory_allocated(device_index),
        "outside": None if proc is None else proc - reserved,
    }


def allocator_reading(device_index: int) -> Dict[str, int]:
    """torch's allocated and reserved bytes now, for the memory series: host-side counters, no synchronize (the
    sampler's thread reads them while the rank computes). One call builds the allocator's nested stats dict, not
    the flattened one torch.cuda.memory_allocated builds from it."""
    import torch

    stats = torch.cuda.memory_stats_as_nested_dict(device_index)
    if not stats:  # the allocator is not initialised yet
        return {}
    return {
        "gpu_alloc": stats["allocated_bytes"]["all"]["current"],
        "gpu_reserved": stats["reserved_bytes"]["all"]["current"],
    }


def take_torch_peaks(device_index: int) -> Dict[str, int]:
    """torch's allocated and reserved peaks since the last reset, then a reset; no synchronize (host-side counters:
    read inside generate, it does not stall it)."""
    import torch

    out = {
        "gpu_alloc_peak": torch.cuda.max_memory_allocated(device_index),
        "gpu_reserved_peak": torch.cuda.max_memory_reserved(device_index),
    }
    torch.cuda.reset_peak_memory_stats(device_index)
    return out


def reset_torch_peaks(device_index: int) -> None:
    import torch

    torch.cuda.synchronize(device_index)
    torch.cuda.reset_peak_memory_stats(device_index)


def nvidia_smi(uuid: Optional[str], pid: Optional[int] = None) -> Dict[str, Optional[int]]:
    """Independent cross-check: what `nvidia-smi` reports for this device and process, in bytes."""
    out: Dict[str, Optional[int]] = {"smi_device_used": None, "smi_process_used": None}
    if uuid is None:
        return out
    pid = pid or os.getpid()
    try:
        gpus = subprocess.run(
            ["nvidia-smi", "--query-gpu=uuid,memory.used", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
        apps = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,gpu_uuid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return out
    for line in gpus.splitlines():
        u, used = [x.strip() for x in line.split(",")[:2]]
        if u == uuid:
            out["smi_device_used"] = int(used) * 2**20
    for line in apps.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) >= 3 and parts[0] == str(pid) and parts[1] == uuid and parts[2].isdigit():
            out["smi_process_used"] = int(parts[2]) * 2**20
    return out
