"""What a run measured, read from its result dict; every accessor tolerates missing fields (failed runs,
results of older or newer schema, runs rebuilt from MLflow params without rank records)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.core.records import node_shared

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


def headline(result: Dict[str, Any], name: str) -> Optional[float]:
    """A headline figure; None for a node-wide one that other jobs packed beside this one shared."""
    if name.startswith("node_") and node_shared(result):
        return None
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
