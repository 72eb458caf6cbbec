"""What a run measured, read from its result dict; every accessor tolerates missing fields (failed runs,
results of older or newer schema, runs rebuilt from MLflow params without rank records)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.core.records import node_shared, speed_representative

MIB, GIB = 2**20, 2**30


def human(nbytes: Optional[float]) -> str:
    """Bytes for a sentence: GiB from 1 GiB up, else MiB, else KiB."""
    if nbytes is None:
        return "?"
    for unit, size in (("GiB", GIB), ("MiB", MIB)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes / 1024:.1f} KiB" if abs(nbytes) >= 1024 else f"{nbytes:.0f} B"


def display_unit(gib_values) -> tuple:
    """("MiB", 1024) when every value (GiB) is below 1 GiB (tiny CPU models), else ("GiB", 1); None ignored."""
    vals = [v for v in gib_values if v is not None]
    return ("MiB", 1024.0) if vals and max(vals) < 1 else ("GiB", 1.0)


def ranks(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    return [r for r in result.get("ranks") or [] if r]


def phase(rank: Dict[str, Any], name: str) -> Dict[str, Any]:
    return (rank.get("phases") or {}).get(name) or {}


def on_gpu(result: Dict[str, Any]) -> bool:
    return ((result.get("runtime") or {}).get("device") or (result.get("config") or {}).get("device")) == "cuda"


def device_word(result: Dict[str, Any]) -> str:
    return "GPU" if on_gpu(result) else "rank (CPU run: its device is the host)"


def weights_per_rank(result: Dict[str, Any]) -> List[int]:
    """Parameter + buffer bytes on each rank's compute device after init (the census)."""
    out = []
    for rk in ranks(result):
        w = phase(rk, "init").get("weights_device")
        if w is not None:
            out.append(int(w))
    return out


def tensors_per_rank(result: Dict[str, Any]) -> List[Dict[str, int]]:
    """Per rank, {tensor name: local bytes on its device} after init (the per-tensor census; empty if not recorded)."""
    return [dict(phase(rk, "init").get("tensors") or {}) for rk in ranks(result)]


def init_recorded(result: Dict[str, Any]) -> bool:
    """Every rank got through init (its census is whole), whether or not the run completed after it."""
    rks = ranks(result)
    return (
        bool(rks)
        and all(phase(rk, "init") and not phase(rk, "init").get("partial") for rk in rks)
        and all((rk.get("error") or {}).get("phase") not in ("start", "load", "init") for rk in rks)
    )


def on_meta(result: Dict[str, Any]) -> List[str]:
    """Tensor names still on the meta device after init, over all ranks (deduplicated)."""
    names: Dict[str, None] = {}
    for rk in ranks(result):
        for n in (phase(rk, "init").get("weights") or {}).get("on_meta") or []:
            names[n] = None
    return list(names)


def buffer_bytes(result: Dict[str, Any], name: str) -> Optional[int]:
    """Rank 0's buffer bytes (all devices) in a phase's census."""
    rk = next(iter(ranks(result)), None)
    census = phase(rk, name).get("weights") if rk else None
    return sum((census.get("buffer_bytes") or {}).values()) if census else None


def load_growth(result: Dict[str, Any], kind: str = "anon") -> List[int]:
    """Per rank: host memory (anon or rss) at the load/init peak minus what the rank held after `start`."""
    out = []
    for rk in ranks(result):
        before = phase(rk, "start").get("host", {}).get(f"host_{kind}")
        peaks = [phase(rk, p).get("peaks", {}).get(f"host_{kind}_peak") for p in ("load", "init")]
        peaks = [p for p in peaks if p is not None]
        if before is not None and peaks:
            out.append(max(peaks) - before)
    return out


SPEED = ("load_s", "init_s", "generate_s", "tokens_per_s")


def headline(result: Dict[str, Any], name: str) -> Optional[float]:
    """A headline figure; None for a node-wide one that other jobs packed beside this one shared, and for a speed
    figure of a run whose ranks shared a GPU (gloo on one device: never compared; `raw_headline` shows it)."""
    if name.startswith("node_") and node_shared(result):
        return None
    if name in SPEED and not speed_representative(result):
        return None
    return raw_headline(result, name)


def raw_headline(result: Dict[str, Any], name: str) -> Optional[float]:
    return (result.get("headline") or {}).get(name)


def per_device_gib(result: Dict[str, Any]) -> Optional[float]:
    """The per-device figure runs are ranked by: GPU peak on GPUs, device-resident weights on CPU runs."""
    return headline(result, "gpu_peak_gib") if on_gpu(result) else headline(result, "gpu_weights_gib")


def completed(result: Dict[str, Any]) -> bool:
    """The run got through every phase (its output may still be wrong): its measurements are whole."""
    return result.get("status") == "ok" or (result.get("failure") or {}).get("cause") == "incorrect_output"


def gpu_max(result: Dict[str, Any], phase_name: str, key: str) -> Optional[int]:
    """A phase's GPU figure (bytes), max over ranks."""
    vals = [(phase(rk, phase_name).get("gpu") or {}).get(key) for rk in ranks(result)]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def passed(result: Dict[str, Any]) -> bool:
    return result.get("status") == "ok" and bool((result.get("correctness") or {}).get("passed"))


def node_growth(result: Dict[str, Any]) -> Optional[int]:
    """Node-wide used memory at its peak minus before launch (bytes)."""
    base = (result.get("baseline") or {}).get("node_used")
    peak = headline(result, "node_host_peak_gib")
    return int(peak * GIB - base) if base is not None and peak is not None else None


OUTSIDE_PARTS = ("context", "communicator", "engine", "generate", "device_reserve")


def _outside(gpu: Dict[str, Any]) -> Optional[int]:
    """NVML process used - torch reserved in one snapshot (None where NVML could not see the process)."""
    proc = (gpu or {}).get("nvml_process_used")
    return None if proc is None else proc - ((gpu or {}).get("gpu_reserved") or 0)


def shared_gpu(result: Dict[str, Any]) -> bool:
    return bool((result.get("runtime") or {}).get("shared_gpu"))


def device_reserve(result: Dict[str, Any], rk: Dict[str, Any]) -> Optional[int]:
    """What the device holds apart from this rank's process: NVML device used - process used at `start`; where ranks
    share the GPU that figure holds the other ranks too, so it is the device's use before the job started."""
    if shared_gpu(result):
        before = (result.get("baseline") or {}).get("gpu_used") or []
        gpu = str((rk.get("shared_gpu") or {}).get("gpu", "0"))
        return before[int(gpu)] if gpu.isdigit() and int(gpu) < len(before) else None
    start = (phase(rk, "start").get("gpu")) or {}
    if start.get("nvml_device_used") is None:
        return None
    return start["nvml_device_used"] - (start.get("nvml_process_used") or 0)


def per_gpu_peak(result: Dict[str, Any], rk: Dict[str, Any]) -> Optional[int]:
    """The rank's GPU at its peak as NVML counts a device: the device's figure; where ranks share the GPU, the rank's
    own process peak plus the device's use before the job (what a GPU of its own would have shown)."""
    phases = (rk.get("phases") or {}).values()
    if shared_gpu(result):
        procs = [(ph.get("peaks") or {}).get("nvml_process_used_peak") or (ph.get("gpu") or {}).get("nvml_process_used")
                 for ph in phases]  # fmt: skip
        proc = max((p for p in procs if p is not None), default=None)
        reserve = device_reserve(result, rk)
        return None if proc is None else proc + (reserve or 0)
    peaks = [(ph.get("peaks") or {}).get("nvml_device_used_peak") or (ph.get("gpu") or {}).get("nvml_device_used")
             for ph in phases]  # fmt: skip
    return max((p for p in peaks if p is not None), default=None)


def outside_parts(result: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Where the device memory outside PyTorch's allocator goes, on the rank with the highest NVML peak (bytes).

    Read from the rank's snapshots in order: after the CUDA context (`start.outside.context`), after the first
    all_reduce (`start.outside.communicator`: the NCCL communicator; absent when none ran), at the end of init
    (load + init: the engine's own process groups, kernels loaded while placing the model), at the end of generate
    (cuBLAS workspaces and kernels, communicator connections made on first use). Each part is the growth of
    NVML process used - torch reserved since the previous snapshot; device_reserve is what NVML counts as used on
    the device apart from this process (at start). unexplained = the per-GPU NVML peak - the allocator's peak
    (reserved) - every part: what neither explains (outside memory that came and went between snapshots, or an
    allocator peak that had been returned by the time the outside memory grew: then it is negative).
    None on CPU runs and where NVML has no per-process figure."""
    best = None
    for rk in ranks(result):
        phases = rk.get("phases") or {}
        start = (phases.get("start") or {}).get("gpu") or {}
        readings = (phases.get("start") or {}).get("outside") or {}
        levels = [
            ("context", _outside(readings.get("context") or {})),
            ("communicator", _outside(readings.get("communicator") or {})),
            ("engine", _outside((phases.get("init") or {}).get("gpu") or {})),
            ("generate", _outside((phases.get("generate") or {}).get("gpu") or {})),
        ]
        if levels[0][1] is None:  # older records: the start snapshot is the first reading
            levels[0] = ("context", _outside(start))
        if levels[0][1] is None or start.get("nvml_device_used") is None:
            continue
        parts: Dict[str, Optional[int]] = {}
        previous = 0
        for name, level in levels:
            parts[name] = None if level is None else level - previous
            previous = previous if level is None else level
        parts["device_reserve"] = device_reserve(result, rk)
        peak = per_gpu_peak(result, rk)
        allocator = max(((ph.get("gpu") or {}).get("gpu_reserved_peak") or 0 for ph in phases.values()), default=0)
        total = sum(v for v in parts.values() if v is not None)
        row = {
            "rank": rk.get("rank"),
            **parts,
            "outside": total,
            "allocator_peak": allocator,
            "nvml_peak": peak,
            "unexplained": None if peak is None else peak - allocator - total,
        }
        if best is None or (peak or 0) > (best["nvml_peak"] or 0):
            best = row
    return best
