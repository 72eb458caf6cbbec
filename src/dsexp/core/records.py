"""Record schema: what a rank writes (rank{N}.json), what a job writes (result.json), and aggregation.

Rank records keep raw bytes and seconds; the job flattens them into `<phase>.<quantity>.<aggregate>`
metrics in GiB (aggregate = max/min/mean/sum over ranks, or rankN) and a few headline figures.
Everything later stages need (analysis, report, MLflow sync) is in result.json.
"""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from dsexp.core.fs import read_json
from dsexp.core.protocol import live_file, rank_file
from dsexp.core.workload import metric_name, parse_phase

GIB = 2**30


class Phase(str, Enum):
    """The phases every workload records, in order (a script's repeated calls add numbered keys: "generate_2")."""

    START = "start"
    LOAD = "load"
    INIT = "init"
    QUANTIZE = "quantize"  # a quant member that quantizes after the engine placed the model (quant=)
    GENERATE = "generate"


PHASES = tuple(p.value for p in Phase)
SCHEMA_VERSION = 1

HEADLINE = (
    "gpu_peak_gib",
    "gpu_weights_gib",
    "host_peak_gib",
    "host_anon_peak_gib",
    "node_host_peak_gib",
    "load_s",
    "init_s",
    "generate_s",
    "tokens_per_s",
)


def phase_kind(key: str) -> str:
    """A phase key's kind: "generate_2" -> "generate" (the second generate call); "generate" -> "generate";
    "generate[b=8,l=2048]" -> "generate" (a point of a workload grid, dsexp.core.workload)."""
    key = key.split("[", 1)[0]
    base, _, n = key.rpartition("_")
    return base if base and n.isdigit() else key


def read_rank_records(job_dir: Path, world_size: int) -> List[Optional[dict]]:
    """Rank records; a rank that did not finish gets the phase it was in from its live file, marked partial."""
    return [
        with_partial_phase(read_json(rank_file(job_dir, r)), read_json(live_file(job_dir, r)), r, world_size)
        for r in range(world_size)
    ]


def with_partial_phase(rec: Optional[dict], live: Optional[dict], rank: int, world_size: int) -> Optional[dict]:
    """Add `live` (the last heartbeat) to an unfinished rank record: `last_alive` and, if the phase it was in is
    not recorded, that phase's measurement so far (`partial: true`). A rank that died before its first
    record gets one built from the heartbeat."""
    if live is None or (rec is not None and rec.get("status") == "ok"):
        return rec
    if rec is None:
        rec = {"rank": rank, "world_size": world_size, "status": "running", "phases": {}, "timeline": [], "error": None}
    rec["last_alive"] = live.get("time")
    phase = live.get("phase")
    if phase and phase not in rec["phases"]:
        rec["phases"][phase] = {
            "wall_s": live.get("elapsed_s"),
            "peaks": live.get("peaks") or {},
            "host": live.get("host") or {},
            "partial": True,
        }
    return rec


def phase_quantities(phase: Dict[str, Any]) -> Dict[str, float]:
    """One phase of one rank as flat {quantity: value}: bytes become *_gib, seconds stay."""
    out: Dict[str, float] = {"wall_s": phase.get("wall_s")}
    for section in ("host", "gpu", "peaks", "nvidia_smi"):
        for k, v in (phase.get(section) or {}).items():
            if isinstance(v, (int, float)) and v is not None:
                out[f"{k}_gib"] = v / GIB
    if phase.get("weights_device") is not None:
        out["weights_device_gib"] = phase["weights_device"] / GIB
    out.update(see_memory_quantities(phase.get("see_memory_usage") or {}))
    out.update(point_quantities(phase.get("point") or {}))
    return {k: v for k, v in out.items() if v is not None}


def point_quantities(point: Dict[str, Any]) -> Dict[str, float]:
    """A workload point's figures (dsexp.rank.generation): the prefill's and the decode's peaks in GiB, the KV
    cache, TTFT/TPOT/e2e p50 and p90 in seconds, tokens/s."""
    out: Dict[str, float] = {}
    for window in ("prefill", "decode"):
        for k, v in (point.get(window) or {}).items():
            if isinstance(v, (int, float)):
                out[f"{window}_{k}_gib"] = v / GIB
    if isinstance(point.get("kv_cache_bytes"), int):
        out["kv_cache_gib"] = point["kv_cache_bytes"] / GIB
    lat = point.get("latency") or {}
    for name in ("ttft", "tpot", "e2e"):
        for q in ("p50", "p90"):
            if isinstance((lat.get(name) or {}).get(q), (int, float)):
                out[f"{name}_{q}_s"] = lat[name][q]
    if isinstance(lat.get("tokens_per_s"), (int, float)):
        out["tokens_per_s"] = lat["tokens_per_s"]
    return out


def point_phases(ranks: List[Optional[dict]]) -> tuple:
    """The metric names of the workload points' phases the ranks recorded (`generate_b8_l2048`)."""
    keys = {k for rec in ranks if rec for k in (rec.get("phases") or {}) if parse_phase(k)}
    return tuple(sorted(metric_name(k) for k in keys))


def point_rate(ranks: List[Optional[dict]]) -> Optional[float]:
    """Generated tokens/s of the first rank's workload points (the largest over a grid), None where none was timed."""
    rec = next((r for r in ranks if r), None) or {}
    rates = [
        ((ph.get("point") or {}).get("latency") or {}).get("tokens_per_s") for ph in (rec.get("phases") or {}).values()
    ]
    rates = [r for r in rates if isinstance(r, (int, float))]
    return max(rates) if rates else None


# DeepSpeed's see_memory_usage prints "GB" but divides by 1024**3: its figures are GiB, like dsexp's.
SEE_MEMORY_FIELDS = {
    "MA_GB": "see_memory_ma_gib",
    "Max_MA_GB": "see_memory_max_ma_gib",
    "CA_GB": "see_memory_ca_gib",
    "Max_CA_GB": "see_memory_max_ca_gib",
    "cpu_used_GB": "see_memory_cpu_used_gib",
}


def see_memory_quantities(printed: Dict[str, Any]) -> Dict[str, float]:
    """What see_memory_usage printed in this phase (rank 0 only, by DeepSpeed's design), as metrics."""
    return {
        name: printed[field]
        for field, name in SEE_MEMORY_FIELDS.items()
        if isinstance(printed.get(field), (int, float))
    }


def aggregate_metrics(ranks: Iterable[Optional[dict]]) -> Dict[str, float]:
    """`<phase>.<quantity>.<agg>` over the ranks that reported that phase, plus the per-node figures."""
    ranks = list(ranks)
    per: Dict[str, Dict[int, float]] = {}
    for rec in ranks:
        if not rec:
            continue
        for pname, phase in (rec.get("phases") or {}).items():
            for q, v in phase_quantities(phase).items():
                per.setdefault(f"{metric_name(pname)}.{q}", {})[rec["rank"]] = v
    out: Dict[str, float] = {}
    for name, by_rank in per.items():
        vals = list(by_rank.values())
        out[f"{name}.max"] = max(vals)
        out[f"{name}.min"] = min(vals)
        out[f"{name}.mean"] = sum(vals) / len(vals)
        out[f"{name}.sum"] = sum(vals)
        for r, v in by_rank.items():
            out[f"{name}.rank{r}"] = v
    out.update(node_metrics(ranks))
    return out


NODE_QUANTITIES = ("node_used_gib", "node_used_peak_gib")


def node_metrics(ranks: List[Optional[dict]]) -> Dict[str, float]:
    """`<phase>.<node quantity>.node_<host>`: each node's used memory (max over its ranks; short hostname).

    One entry on a single node; a multi-node job shows whether host memory grows on every node or one.
    """
    out: Dict[str, float] = {}
    for rec in ranks:
        if not rec:
            continue
        host = str(rec.get("hostname") or "unknown").split(".")[0]
        for pname, phase in (rec.get("phases") or {}).items():
            q = phase_quantities(phase)
            for name in NODE_QUANTITIES:
                if name in q:
                    key = f"{metric_name(pname)}.{name}.node_{host}"
                    out[key] = max(out.get(key, 0.0), q[name])
    return out


def _max_over(metrics: Dict[str, float], quantity: str, phases=PHASES) -> Optional[float]:
    vals = [metrics[f"{p}.{quantity}.max"] for p in phases if f"{p}.{quantity}.max" in metrics]
    return max(vals) if vals else None


def _max_of(*vals: Optional[float]) -> Optional[float]:
    known = [v for v in vals if v is not None]
    return max(known) if known else None


def phase_ended(ranks: List[Optional[dict]], phase: str) -> bool:
    """Every rank that entered `phase` ended it: not cut short by its error, not known only from a heartbeat
    (a phase that never ended has no duration to show, only how long it ran before it stopped)."""
    entered = [r for r in ranks if r and phase in (r.get("phases") or {})]
    return bool(entered) and all(
        not r["phases"][phase].get("partial") and (r.get("error") or {}).get("phase") != phase for r in entered
    )


def headline(
    metrics: Dict[str, float], ranks: List[Optional[dict]], new_tokens: int, shared_gpu: bool = False
) -> Dict[str, Optional[float]]:
    """The figures a user compares first. Per-device figures are max over ranks; definitions: docs/user-guide.md.

    shared_gpu (ranks sharing a GPU over gloo): the per-GPU peak is each rank's own (NVML per process, which holds
    what a rank holds on a GPU of its own but the device's reserve), the device-wide figure is a node figure
    (`node_gpu_peak_gib`: every rank on it); its times are gloo's on one GPU (`speed_representative`). The host peak
    per rank is the kernel's high-water mark of its RSS read at each phase end (exact) where the record has it, else
    the sampler's peak."""
    phases = PHASES + point_phases(ranks)  # a grid's points are generate phases too
    device_peak = _max_over(metrics, "nvml_device_used_peak_gib", phases) or _max_over(
        metrics, "gpu_driver_used_gib", phases
    )
    gpu_peak = _max_over(metrics, "nvml_process_used_peak_gib", phases) if shared_gpu else device_peak
    gen_s = metrics.get("generate.wall_s.max") if phase_ended(ranks, "generate") else None
    out = {
        "gpu_peak_gib": gpu_peak,
        # the weights as generate found them: after a quant member's own phase where it ran one
        "gpu_weights_gib": metrics.get("quantize.weights_device_gib.max", metrics.get("init.weights_device_gib.max")),
        "host_peak_gib": _max_of(
            _max_over(metrics, "host_rss_peak_gib", phases), _max_over(metrics, "host_rss_hwm_gib", phases)
        ),
        "host_anon_peak_gib": _max_over(metrics, "host_anon_peak_gib", phases),
        "node_host_peak_gib": _max_over(metrics, "node_used_peak_gib", phases),
        "load_s": metrics.get("load.wall_s.max") if phase_ended(ranks, "load") else None,
        "init_s": metrics.get("init.wall_s.max") if phase_ended(ranks, "init") else None,
        "generate_s": gen_s,
        "tokens_per_s": point_rate(ranks) or ((new_tokens / gen_s) if gen_s else None),
    }
    if shared_gpu:
        out["node_gpu_peak_gib"] = device_peak
    return out


def speed_representative(result: Dict[str, Any]) -> bool:
    """False for a run whose ranks shared GPUs (gloo on one device): its phase times and tokens/s are not a
    multi-GPU machine's and stay out of speed comparisons."""
    return not (result.get("runtime") or {}).get("shared_gpu")


def node_shared(result: Dict[str, Any]) -> bool:
    """True if other jobs of the sweep ran while this one did (launcher.pack): its node-wide figures are not its own."""
    return bool((result.get("packed") or {}).get("overlapped_with"))
