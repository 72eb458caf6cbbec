"""What a run measured, read through its typed record (`core.result.JobRecord`; a result dict is taken too); every
accessor tolerates missing fields (failed runs, results of older or newer schema, runs rebuilt from MLflow params
without rank records)."""

from __future__ import annotations

from typing import Any, Dict, List, Mapping, Optional, Union

from dsexp.core.result import JobRecord, Phase, RankRecord

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


Result = Union[JobRecord, Mapping[str, Any]]  # a result.json dict or its typed view


def on_gpu(result: Result) -> bool:
    return JobRecord.of(result).on_gpu


def device_word(result: Result) -> str:
    return "GPU" if on_gpu(result) else "rank (CPU run: its device is the host)"


def weights_per_rank(result: Result) -> List[int]:
    """Parameter + buffer bytes on each rank's compute device after init (the census; a script with no engine
    call: as it left its model)."""
    weights = (rk.weights_held for rk in JobRecord.of(result).ranks)
    return [w for w in weights if w is not None]


def tensors_per_rank(result: Result) -> List[Dict[str, int]]:
    """Per rank, {tensor name: local bytes on its device} after init (the per-tensor census; empty if not recorded)."""
    return [rk.placed.tensors for rk in JobRecord.of(result).ranks]


def init_recorded(result: Result) -> bool:
    """Every rank got through init (its census is whole), whether or not the run completed after it."""
    rks = JobRecord.of(result).ranks
    return (
        bool(rks)
        and all(rk.phase(Phase.INIT).recorded and not rk.phase(Phase.INIT).partial for rk in rks)
        and all(rk.failed_in not in ("start", "load", "init") for rk in rks)
    )


def on_meta(result: Result) -> List[str]:
    """Tensor names still on the meta device after init, over all ranks (deduplicated)."""
    names: Dict[str, None] = {}
    for rk in JobRecord.of(result).ranks:
        for n in rk.phase(Phase.INIT).census.get("on_meta") or []:
            names[n] = None
    return list(names)


def buffer_bytes(result: Result, name: str) -> Optional[int]:
    """Rank 0's buffer bytes (all devices) in a phase's census."""
    rk = next(iter(JobRecord.of(result).ranks), None)
    census = rk.phase(name).census if rk else None
    return sum((census.get("buffer_bytes") or {}).values()) if census else None


def start_host(result: Result, kind: str = "rss") -> List[int]:
    """Per rank: host memory (rss or anon) after `start` (the interpreter and libraries, before any weights)."""
    vals = (rk.phase(Phase.START).host.get(f"host_{kind}") for rk in JobRecord.of(result).ranks)
    return [v for v in vals if v is not None]


def load_growth(result: Result, kind: str = "anon") -> List[int]:
    """Per rank: host memory (anon or rss) at the load/init peak minus what the rank held after `start`."""
    out = []
    for rk in JobRecord.of(result).ranks:
        before = rk.phase(Phase.START).host.get(f"host_{kind}")
        peaks = [rk.phase(p).peaks.get(f"host_{kind}_peak") for p in (Phase.LOAD, Phase.INIT)]
        peaks = [p for p in peaks if p is not None]
        if before is not None and peaks:
            out.append(max(peaks) - before)
    return out


SPEED = ("load_s", "init_s", "generate_s", "tokens_per_s")


def headline(result: Result, name: str) -> Optional[float]:
    """A headline figure; None for a node-wide one that other jobs packed beside this one shared, and for a speed
    figure of a run whose ranks shared a GPU (gloo on one device: never compared; `raw_headline` shows it)."""
    job = JobRecord.of(result)
    if name.startswith("node_") and job.node_shared:
        return None
    if name in SPEED and not job.speed_representative:
        return None
    return job.headline(name)


def raw_headline(result: Result, name: str) -> Optional[float]:
    return JobRecord.of(result).headline(name)


def per_device_gib(result: Result) -> Optional[float]:
    """The per-device figure runs are ranked by: GPU peak on GPUs, device-resident weights on CPU runs."""
    return headline(result, "gpu_peak_gib") if on_gpu(result) else headline(result, "gpu_weights_gib")


def completed(result: Result) -> bool:
    """The run got through every phase (its output may still be wrong): its measurements are whole."""
    return JobRecord.of(result).completed


def gpu_max(result: Result, phase_name: str, key: str) -> Optional[int]:
    """A phase's GPU figure (bytes), max over ranks."""
    vals = [rk.phase(phase_name).gpu.get(key) for rk in JobRecord.of(result).ranks]
    vals = [v for v in vals if v is not None]
    return max(vals) if vals else None


def passed(result: Result) -> bool:
    return JobRecord.of(result).passed


def node_growth(result: Result) -> Optional[int]:
    """Node-wide used memory at its peak minus before launch (bytes)."""
    base = JobRecord.of(result).baseline.get("node_used")
    peak = headline(result, "node_host_peak_gib")
    return int(peak * GIB - base) if base is not None and peak is not None else None


OUTSIDE_PARTS = ("context", "communicator", "engine", "generate", "device_reserve")


def _outside(gpu: Mapping[str, Any]) -> Optional[int]:
    """NVML process used - torch reserved in one snapshot (None where NVML could not see the process)."""
    proc = gpu.get("nvml_process_used")
    return None if proc is None else proc - (gpu.get("gpu_reserved") or 0)


def shared_gpu(result: Result) -> bool:
    return JobRecord.of(result).shared_gpu


def device_reserve(result: Result, rk: RankRecord) -> Optional[int]:
    """What the device holds apart from this rank's process: NVML device used - process used at `start`; where ranks
    share the GPU that figure holds the other ranks too, so it is the device's use before the job started."""
    job = JobRecord.of(result)
    if job.shared_gpu:
        before = job.baseline.get("gpu_used") or []
        gpu = str(rk.shared_gpu.get("gpu", "0"))
        return before[int(gpu)] if gpu.isdigit() and int(gpu) < len(before) else None
    start = rk.phase(Phase.START).gpu
    if start.get("nvml_device_used") is None:
        return None
    return start["nvml_device_used"] - (start.get("nvml_process_used") or 0)


def per_gpu_peak(result: Result, rk: RankRecord) -> Optional[int]:
    """The rank's GPU at its peak as NVML counts a device: the device's figure; where ranks share the GPU, the rank's
    own process peak plus the device's use before the job (what a GPU of its own would have shown)."""
    if shared_gpu(result):
        proc = rk.max_over_phases("nvml_process_used")
        return None if proc is None else proc + (device_reserve(result, rk) or 0)
    return rk.max_over_phases("nvml_device_used")


def outside_parts(result: Result) -> Optional[Dict[str, Any]]:
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
    for rk in JobRecord.of(result).ranks:
        start = rk.phase(Phase.START)
        levels = [
            ("context", _outside(start.outside.get("context") or {})),
            ("communicator", _outside(start.outside.get("communicator") or {})),
            ("engine", _outside(rk.phase(Phase.INIT).gpu)),
            ("generate", _outside(rk.phase(Phase.GENERATE).gpu)),
        ]
        if levels[0][1] is None:  # older records: the start snapshot is the first reading
            levels[0] = ("context", _outside(start.gpu))
        if levels[0][1] is None or start.gpu.get("nvml_device_used") is None:
            continue
        parts: Dict[str, Optional[int]] = {}
        previous = 0
        for name, level in levels:
            parts[name] = None if level is None else level - previous
            previous = previous if level is None else level
        parts["device_reserve"] = device_reserve(result, rk)
        peak = per_gpu_peak(result, rk)
        allocator = max((ph.gpu.get("gpu_reserved_peak") or 0 for ph in rk.phases()), default=0)
        total = sum(v for v in parts.values() if v is not None)
        row = {
            "rank": rk.rank,
            **parts,
            "outside": total,
            "allocator_peak": allocator,
            "nvml_peak": peak,
            "unexplained": None if peak is None else peak - allocator - total,
        }
        if best is None or (peak or 0) > (best["nvml_peak"] or 0):
            best = row
    return best


def speed_representative(result: Result) -> bool:
    """Its phase times and tokens/s are a multi-GPU machine's (not gloo between ranks sharing a GPU)."""
    return JobRecord.of(result).speed_representative
