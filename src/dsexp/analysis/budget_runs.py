"""A budget search read back: each point's figures from a job's result, and the search's answer.

The search (dsexp.compose.budget) writes `<sweep>/budget.json`: the budget, the batches, per configuration its
prediction, the points it ran (job folder, status) and its bracket. The figures of a point come from the job's
result.json: per rank the device need (on a GPU the allocator's reserved peak over everything the point ran, warm-up
included, plus what the process holds outside it; on a CPU run the simulated need the rank checked,
dsexp.rank.budget_cap), tokens/s and the time to first token; per job the host bytes its ranks held (each rank's
largest RSS, summed). A user's script's job runs one batch (its {batch_size}): its point is every generate call it
made, the busiest one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.analysis.measured import node_growth
from dsexp.analysis.user_script import is_script
from dsexp.core.fs import read_json
from dsexp.core.records import phase_kind, phase_quantities
from dsexp.core.result import JobRecord, RankRecord
from dsexp.core.workload import NOT_MEASURED

STATE_FILE = "budget.json"
GIB = 2**30
# why a search over a user's script counts jobs: said by the search when it starts and by the report's runs line
ONE_BATCH_PER_JOB = (
    "a script's job runs one batch, its {batch_size}: it cannot run a grid inside one load, so each run is a job"
)


def job_name(job_dir: Any) -> str:
    """A job's folder name: its number in the sweep (results copied elsewhere keep it, not their absolute path)."""
    return Path(str(job_dir)).name


def result_key(result: Dict[str, Any]) -> str:
    """How a search's point finds its job's result: the job's folder name, under its search's folder name where
    several searches are read as one (dsexp.analysis.budget_merge tags each result with it)."""
    name = job_name(result.get("job_dir"))
    return f"{result['sweep']}/{name}" if result.get("sweep") else name


def point_key(config: Dict[str, Any], point: Dict[str, Any]) -> str:
    """result_key's counterpart for a point of a configuration (merged: the configuration names its search)."""
    name = job_name(point.get("job"))
    return f"{config['search']}/{name}" if config.get("search") else name


def read_search(sweep_dir: Path) -> Optional[Dict[str, Any]]:
    return read_json(Path(sweep_dir) / STATE_FILE)


def script_batch(result: Dict[str, Any]) -> Optional[int]:
    """A user's script's job: the one batch its {batch_size} took (None: not a script's job)."""
    if not is_script(result):
        return None
    return int(((result.get("config") or {}).get("generate") or {}).get("batch_size") or 1)


def script_generate_phases(result: Dict[str, Any]) -> List[str]:
    """Every generate call's phase a rank of a script's job opened (generate, generate_2, ...), in order."""
    keys = [k for rk in JobRecord.of(result).ranks for k in rk.phase_keys if phase_kind(k) == "generate"]
    return list(dict.fromkeys(keys))


def point_phases(result: Dict[str, Any], batch: int) -> List[str]:
    """The phases that ran this batch: a point of dsexp's grid, or every generate call of a script's job at it."""
    if is_script(result):
        return script_generate_phases(result) if script_batch(result) == batch else []
    key = point_phase(result, batch)
    return [key] if key else []


def point_phase(result: Dict[str, Any], batch: int) -> Optional[str]:
    """The phase key the ranks ran this batch in (None: not run)."""
    if is_script(result):
        return next(iter(point_phases(result, batch)), None)
    for rk in JobRecord.of(result).ranks:
        for e in rk.raw.get("points") or []:
            if int(e.get("batch", -1)) == batch and e.get("status") not in NOT_MEASURED:
                return e.get("phase") or "generate"
    return None


def rank_need(rk: RankRecord, phase_key: str) -> Optional[int]:
    """One rank's device need at a point (module docstring)."""
    phase = rk.phase(phase_key).raw or {}
    simulated = (phase.get("budget") or {}).get("simulated_need")
    if simulated is not None:
        return int(simulated)
    point = phase.get("point") or {}
    # the point's whole phase (its warm-up calls too: a figure the answer states must hold for everything the point
    # ran), beside its measured prefill and decode windows; a script's generate call: the phase's own peak
    windows = [(point.get(w) or {}).get("gpu_reserved_peak") for w in ("prefill", "decode")] if point else []
    reserved = [r for r in [*windows, (phase.get("gpu") or {}).get("gpu_reserved_peak")] if r is not None]
    if not reserved:
        return None
    return max(reserved) + int((rk.raw.get("budget") or {}).get("outside_bytes") or 0)


def device_per_rank(result: Dict[str, Any], batch: int) -> List[Optional[int]]:
    """Each rank's device need at this batch (a script's: the most over its generate calls)."""
    return per_rank_at(result, batch, rank_need)


def nvml_per_rank(result: Dict[str, Any], batch: int) -> List[Optional[int]]:
    """Each rank's process memory at this batch as NVML saw it (its sampled peak over the point's phase), beside the
    allocator's figure the answer states; None where NVML gave no per-process figure (a CPU run)."""
    return per_rank_at(result, batch, lambda rk, key: rk.phase(key).peaks.get("nvml_process_used_peak"))


def per_rank_at(result: Dict[str, Any], batch: int, figure) -> List[Optional[int]]:
    """figure(rank, phase key) at its largest over the phases that ran this batch, per rank."""
    keys = point_phases(result, batch)
    out = []
    for rk in JobRecord.of(result).ranks:
        vals = [v for v in (figure(rk, k) for k in keys if k in rk.phase_keys) if v is not None]
        out.append(max(vals) if vals else None)
    return out


def host_need(result: Dict[str, Any]) -> Optional[int]:
    """Host bytes the job needed: the node's used memory at its peak minus before launch (private memory; the
    checkpoint's pages the ranks map are page cache, which the kernel reclaims, so a rank's RSS overstates it), or,
    where the node was not read, each rank's largest RSS summed over ranks."""
    growth = node_growth(result)
    if growth is not None:
        return growth
    total, seen = 0, False
    for rk in JobRecord.of(result).ranks:
        peaks = [
            max(q.get("host_rss_peak_gib", 0.0), q.get("host_rss_hwm_gib", 0.0))
            for q in (phase_quantities(ph.raw) for ph in rk.phases())
        ]
        if peaks:
            total += int(max(peaks) * GIB)
            seen = True
    return total if seen else None


def speed(result: Dict[str, Any], batch: int) -> Dict[str, Optional[float]]:
    """Tokens/s and TTFT (p50) of rank 0 at this batch (a script: its generate calls' tokens/s, no TTFT: its calls
    are not split into a prefill and a decode)."""
    if is_script(result):
        return {"tokens_per_s": (result.get("headline") or {}).get("tokens_per_s"), "ttft_s": None}
    key = point_phase(result, batch)
    rank0 = next(iter(JobRecord.of(result).ranks), None)
    point = (rank0.phase(key).raw or {}).get("point") or {} if rank0 and key else {}
    lat = point.get("latency") or {}
    return {"tokens_per_s": lat.get("tokens_per_s"), "ttft_s": (lat.get("ttft") or {}).get("p50")}


def enforcement(results: List[Dict[str, Any]]) -> Optional[str]:
    """How the budget was held on the ranks: 'enforced' (allocator cap), 'simulated' (CPU) or None (not recorded)."""
    hows = {(rk.raw.get("budget") or {}).get("how") for res in results for rk in JobRecord.of(res).ranks if rk.raw} - {
        None
    }
    return "enforced" if "enforced" in hows else ("simulated" if "simulated" in hows else None)


@dataclass
class Candidate:
    """A configuration that ran within the budget, at its largest batch."""

    key: str
    tp: int
    batch: int
    tokens_per_s: Optional[float]
    ttft_s: Optional[float]
    device: List[Optional[int]]
    host: Optional[int]
    job: str
    entry: Dict[str, Any] = field(default_factory=dict)
    shared_gpu: bool = False  # its ranks shared one GPU over gloo: its times are gloo's
    nvml: List[Optional[int]] = field(default_factory=list)  # NVML's process figure per rank, beside `device`
    after: Optional[int] = None  # the batch its job ran just before it in the same load (None: the load's first)
    as_load: Optional[bool] = None  # whether it started with the load's allocator state (None: not recorded)
    quality: Optional[Dict[str, Any]] = None  # a quantized run's correctness against tp=1 unquantized (quant=)


def candidates(search: Dict[str, Any], results: Dict[str, Dict[str, Any]]) -> List[Candidate]:
    """Every configuration with a largest batch that ran and no failure (wrong output, a crash, over the host
    budget), best first: by_speed, or by_batch where ranks shared a GPU. results: by result_key."""
    out = []
    for c in search.get("configs") or []:
        b = c.get("largest_ok")
        if b is None or c.get("failed"):
            continue
        point = answer_point(c, b)
        res = results.get(point_key(c, point)) if point else None
        if res is None:
            continue
        sp = speed(res, b)
        out.append(
            Candidate(
                c["key"],
                c["tp"],
                b,
                sp["tokens_per_s"],
                sp["ttft_s"],
                device_per_rank(res, b),
                host_need(res),
                point_key(c, point),
                c,
                bool((res.get("runtime") or {}).get("shared_gpu")),
                nvml_per_rank(res, b),
                ran_before(res, b),
                started_as_load(res, b),
                quality_of(res),
            )
        )
    out.sort(key=by_speed if not any(x.shared_gpu for x in out) else by_batch)
    return out


def quality_of(res: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """What a quantized configuration costs in quality (its job's correctness check, against the tp=1 run without
    quantization); None for a run in the model's own dtype."""
    corr = res.get("correctness") or {}
    return dict(corr) if corr.get("quant") else None


def answer_point(config: Dict[str, Any], batch: int) -> Optional[Dict[str, Any]]:
    """The point whose job the answer at `batch` cites: where the batch ran as a load's first point too (the search
    confirmed it in a fresh load: dsexp.compose.budget.search.fresh_answer), that one, the figures a fresh server
    meets; else the first that ran."""
    ran = [p for p in config.get("points") or [] if p["batch"] == batch and p["status"] == "ok"]
    return next((p for p in ran if p.get("first")), ran[0] if ran else None)


def ran_before(result: Dict[str, Any], batch: int) -> Optional[int]:
    """The batch the job's first rank ran (or ran out of memory at) just before `batch` in its load; None where
    `batch` was its first."""
    ranks = JobRecord.of(result).ranks
    entries = (ranks[0].raw.get("points") or []) if ranks else []
    ran = [e["batch"] for e in entries if e.get("status") in ("ok", "oom")]
    i = ran.index(batch) if batch in ran else 0
    return ran[i - 1] if i > 0 else None


def point_starts(result: Dict[str, Any]) -> Dict[int, List[Dict[str, Any]]]:
    """batch -> each rank's `start` of its point there (the allocator's state the point started with,
    dsexp.rank.workloads.pipeline; {} where a rank recorded none), for the points that ran or ran out of memory."""
    out: Dict[int, List[Dict[str, Any]]] = {}
    for rank in JobRecord.of(result).ranks:
        for e in rank.raw.get("points") or []:
            if e.get("status") in ("ok", "oom"):
                out.setdefault(int(e["batch"]), []).append(e.get("start") or {})
    return out


def started_as_load(result: Dict[str, Any], batch: int) -> Optional[bool]:
    """Whether every rank started `batch` with the allocator's state the load left; None where a rank did not record
    it (a CPU run, or a job from before the records had it)."""
    flags = [s.get("as_load") for s in point_starts(result).get(batch, [])]
    return None if not flags or None in flags else all(flags)


def not_as_load(result: Dict[str, Any]) -> Dict[int, int]:
    """batch -> the cached bytes (reserved, unallocated) it started with, on the rank with most, for each point of
    the job that some rank did not start with the allocator's state the load left: points the search does not
    count."""
    return {
        b: max(s["reserved"] - s["allocated"] for s in starts if s.get("as_load") is False)
        for b, starts in point_starts(result).items()
        if any(s.get("as_load") is False for s in starts)
    }


def by_speed(c: Candidate):
    """Fastest first: tokens/s at the largest batch; fewer GPUs, then the larger batch, break ties."""
    return (-(c.tokens_per_s or 0.0), c.tp, -c.batch)


def by_batch(c: Candidate):
    """Where ranks shared one GPU, tokens/s are gloo's (a multi-GPU machine's NCCL is another order), so no speed
    is compared: the largest batch first (the most sequences served at once), then fewer GPUs, then the lower
    per-GPU peak (the wider margin to the budget), then the lower host peak."""
    return (-c.batch, c.tp, max((d or 0 for d in c.device), default=0), c.host or 0)


def closest_miss(search: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """Where nothing fits: the configuration that comes closest at the smallest batch (predicted misses by their
    overshoot, measured ones by the model's need plus their measured gap), with the term that fails first. A
    configuration whose search stopped before it reached the smallest batch is no miss (the report lists it as
    stopped)."""
    device, best = search["budget"]["device"], None
    smallest = (search.get("batches") or [1])[0]
    for c in search.get("configs") or []:
        miss = c.get("miss")
        measured_at_min = any(p.get("batch") == smallest and p.get("status") != "ok" for p in c.get("points") or [])
        if miss and miss["where"] in ("device", "host"):
            over, term = miss["need"] - miss["budget"], miss["term"]
        elif not miss and c.get("largest_ok") is None and measured_at_min:
            over, term = (c["needs"][0] + (c.get("gap") or 0)) - device, "measured out of memory at the smallest batch"
        else:
            continue
        if best is None or over < best["over"]:
            best = {"key": c["key"], "over": over, "term": term, "text": (miss or {}).get("text")}
    return best
