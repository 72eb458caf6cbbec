"""Each run's workload points, measured and predicted: memory above the weights per rank against tokens (B x L),
latency against batch, and the largest batch the memory model says fits the GPU a run had (dsexp.predict.capacity).

Measured above the weights, per rank and point: on a GPU, torch's allocated peak during the point's prefill or decode
(whichever is higher) minus what the rank held allocated at the end of init (the weights); on the CPU, the KV cache
the generate call returned (what is countable there: the host's RSS is the allocator's business, not the model's).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from dsexp.analysis.labels import config_label
from dsexp.analysis.matrix import Row
from dsexp.core.result import Phase
from dsexp.core.workload import NOT_MEASURED, parse_phase
from dsexp.predict import capacity as cap


@dataclass
class PointRow:
    """One workload point of one run: what each rank measured and what the memory model predicts for it."""

    config: str  # the configuration without its workload (analysis.labels.config_label(workload=False))
    tp: int
    batch: int
    prompt_tokens: int
    new_tokens: int
    status: str  # ok | oom | skipped | not_run (dsexp.job.oom_relaunch)
    on_gpu: bool
    measured: List[Optional[int]]  # bytes above the weights per rank (None where not measured)
    predicted: Optional[List[int]]  # the model's figure for the same: its peak above the weights (CPU: KV cache)
    terms: Optional[Dict[str, List[int]]]
    latency: Dict[str, Any]
    oom_message: Optional[str] = None  # rank 0's out-of-memory error at this point, as PyTorch worded it

    @property
    def tokens(self) -> int:
        return self.batch * self.prompt_tokens

    @property
    def measured_max(self) -> Optional[int]:
        vals = [v for v in self.measured if v is not None]
        return max(vals) if vals else None

    @property
    def predicted_max(self) -> Optional[int]:
        return max(self.predicted) if self.predicted else None


def prompt_lengths(row: Row) -> Dict[str, int]:
    """{phase key: the prompt's length in tokens} from rank 0's points (a text prompt's length is its ids')."""
    rank0 = next(iter(row.record.ranks), None)
    out = {}
    for key in rank0.phase_keys if rank0 else ():
        point = rank0.phase(key).point
        if point.get("prompt_len"):
            out[key] = int(point["prompt_len"])
    return out


def point_rows(rows: List[Row]) -> List[PointRow]:
    """Every workload point of every run that recorded one, in the order the runs and points came."""
    out = []
    for row in rows:
        lengths = prompt_lengths(row)
        for entry in _points(row):
            length = entry.get("prompt_tokens") or lengths.get(entry["phase"])
            if not length:
                continue
            out.append(point_row(row, entry, int(length)))
    return out


def _points(row: Row) -> List[Dict[str, Any]]:
    """The points rank 0 listed (`points`), or the phases named as points where a record has no list."""
    rank0 = next(iter(row.record.ranks), None)
    if rank0 is None:
        return []
    if rank0.points:
        return list(rank0.points)
    found = [(k, parse_phase(k)) for k in rank0.phase_keys]
    return [{**p.to_dict(), "phase": k, "status": "ok"} for k, p in found if p]


def point_row(row: Row, entry: Dict[str, Any], length: int) -> PointRow:
    new = int((row.config.get("generate") or {}).get("new_tokens") or 1)
    measured = [above_weights_measured(rank, entry["phase"], row.record.on_gpu) for rank in row.record.ranks]
    terms = predicted = None
    p = row.prediction
    if p is not None and p.dims.hidden:
        terms = cap.above_weights(p.dims, p.strategy, row.tp, cap.Workload(entry["batch"], length, new))
        predicted = cap.peak_per_rank([0] * row.tp, terms) if row.record.on_gpu else kv_at_end(row, entry, length)
    rank0 = next(iter(row.record.ranks), None)
    point = rank0.phase(entry["phase"]).point if rank0 else {}
    return PointRow(
        config=config_label(row.config, workload=False),
        tp=row.tp,
        batch=int(entry["batch"]),
        prompt_tokens=length,
        new_tokens=new,
        status=entry.get("status", "ok"),
        on_gpu=row.record.on_gpu,
        measured=measured,
        predicted=predicted,
        terms=terms,
        latency=point.get("latency") or {},
        oom_message=(entry.get("error") or {}).get("message"),
    )


def kv_at_end(row: Row, entry: Dict[str, Any], length: int) -> List[int]:
    """The KV cache the model predicts when generate returns (prompt + new - 1 tokens): what a CPU run counts, the
    tensors' own bytes (no caching allocator rounds them there)."""
    p, new = row.prediction, int((row.config.get("generate") or {}).get("new_tokens") or 1)
    shapes, e = cap.Shapes.of(p.dims), cap.DTYPE_BYTES[p.strategy.dtype]
    return [
        cap.cache_at_end(
            shapes,
            cap.rank_heads(shapes, p.strategy, row.tp, r)["kv_heads"],
            entry["batch"],
            length,
            new,
            e,
            p.strategy,
        )
        for r in range(row.tp)
    ]


def above_weights_measured(rank, key: str, on_gpu: bool) -> Optional[int]:
    """A rank's bytes above its weights at a point (module docstring); None where the point did not run there."""
    point = rank.phase(key).point
    if not point or "out_of_memory" in point:
        return None
    if not on_gpu:
        return point.get("kv_cache_bytes")
    peaks = [(point.get(w) or {}).get("gpu_alloc_peak") for w in ("prefill", "decode")]
    peaks = [v for v in peaks if v is not None]
    weights = rank.placed.gpu.get("gpu_alloc")
    return max(peaks) - weights if peaks and weights is not None else None


def device_bytes(row: Row) -> Optional[int]:
    """The GPU the run had: its total memory as torch saw it at `start`."""
    for rank in row.record.ranks:
        total = rank.phase(Phase.START).gpu.get("gpu_total")
        if total:
            return int(total)
    return None


@dataclass
class Fit:
    """The largest batch at one prompt length: what the model says fits the run's GPU, and the largest that ran."""

    config: str
    tp: int
    prompt_tokens: int
    new_tokens: int
    predicted: int
    ran: Optional[int]  # the largest batch that ran at this length (None: none did)
    out_of_memory: Optional[int]  # the smallest batch that ran out of memory at this length
    cause: Optional[str]  # a limit other than memory (kernel injection's max_out_tokens)


def largest_batches(rows: List[Row], points: List[PointRow]) -> List[Fit]:
    """For each GPU run with a prediction and each prompt length of its grid, the largest batch that fits its GPU
    (where its ranks shared one, each rank's share of it)."""
    out, seen = [], set()
    for row in rows:
        p, total = row.prediction, device_bytes(row)
        if p is None or not total or not p.dims.hidden:
            continue
        label = config_label(row.config, workload=False)
        if (label, row.tp) in seen:  # a search's several jobs of one configuration: one table row per length
            continue
        seen.add((label, row.tp))
        budget = gpu_budget(row, total)
        mine = [q for q in points if q.config == label and q.tp == row.tp]
        for length in sorted({q.prompt_tokens for q in mine}):
            at = [q for q in mine if q.prompt_tokens == length]
            new = at[0].new_tokens
            ran = [q.batch for q in at if q.status == "ok"]
            oom = [q.batch for q in at if q.status == "oom"]
            best = cap.largest_batch(p.dims, p.strategy, row.tp, p.reserve, length, new, budget, p.overhead or 0)
            cause = cap.limit_cause(p.strategy, cap.Workload(1, length, new))
            largest_ran, first_oom = max(ran) if ran else None, min(oom) if oom else None
            out.append(Fit(label, row.tp, length, new, best, largest_ran, first_oom, cause))
    return out


def gpu_budget(row: Row, total: int) -> int:
    """What one rank may use: a budget search's GPU (budget.gpu_gib, not the card the run borrowed), else the run's
    GPU (ranks sharing one, launcher.gpus=1: each its share)."""
    gib = (row.config.get("budget") or {}).get("gpu_gib")
    if gib:
        return int(float(gib) * 2**30)
    return total // (row.tp if row.record.shared_gpu else 1)


FILES = {"capacity": "memory_vs_tokens.png", "latency": "latency_vs_batch.png"}
GIB = 2**30


def write_plots(points: List[PointRow], folder) -> Dict[str, Any]:
    """The capacity plots ({name: file}) where the sweep has workload points: memory above the weights against
    tokens, and (where timed points exist) latency against batch."""
    from pathlib import Path

    from dsexp.analysis import plots

    if not points:
        return {}
    folder = Path(folder)
    memory: plots.TokenSeries = {}
    latency: plots.LatencySeries = {}
    for q in points:
        s = memory.setdefault((q.config, q.tp), {"measured": [], "oom": []})
        if q.predicted_max is not None and q.status not in NOT_MEASURED:  # nothing measured there to compare
            s.setdefault(f"predicted L={q.prompt_tokens}", []).append((q.tokens, q.predicted_max / GIB))
        if q.status == "ok" and q.measured_max is not None:
            s["measured"].append((q.tokens, q.measured_max / GIB))
        if q.status == "oom" and q.predicted_max is not None:
            s["oom"].append((q.tokens, q.predicted_max / GIB))
        rate, tpot = q.latency.get("tokens_per_s"), (q.latency.get("tpot") or {}).get("p50")
        if older_negative_tpot(q.latency):
            tpot = None
        if q.status == "ok" and rate:
            latency.setdefault((q.config, q.tp, q.prompt_tokens), []).append((q.batch, rate, tpot))
    out = {"capacity": plots.memory_vs_tokens(memory, any(q.on_gpu for q in points), folder / FILES["capacity"])}
    if latency:
        out["latency"] = plots.latency_vs_batch(latency, folder / FILES["latency"])
    return out


@dataclass
class Fragmented:
    """An out-of-memory error with room left: what PyTorch's caching allocator said when it failed (bytes)."""

    requested: int
    allocated: int  # allocated by PyTorch when it failed
    unallocated: int  # reserved by PyTorch but unallocated
    allowed: int  # the process's cap (set_per_process_memory_fraction), where one was set

    @property
    def needed(self) -> int:
        return self.allocated + self.requested


_UNIT = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
_SIZE = r"([\d.]+) (B|KiB|MiB|GiB|TiB)"


def _bytes(match, i: int) -> int:
    return int(float(match.group(i)) * _UNIT[match.group(i + 1)])


def fragmentation(message: Optional[str]) -> Optional[Fragmented]:
    """The failure of a capped allocator whose allocated bytes plus the request fit the cap (None otherwise): the
    free bytes were there, split in cached blocks none of which could hold the request. Read from the message
    PyTorch's CUDA caching allocator writes ("Tried to allocate X", "Y allowed", "A is allocated by PyTorch, and R
    is reserved by PyTorch but unallocated")."""
    text = str(message or "")
    tried = re.search(r"Tried to allocate " + _SIZE, text)
    allowed = re.search(_SIZE + r" allowed", text)
    held = r" is allocated by PyTorch, and " + _SIZE + r" is reserved by PyTorch but unallocated"
    split = re.search(_SIZE + held, text)
    if not (tried and allowed and split):
        return None
    found = Fragmented(_bytes(tried, 1), _bytes(split, 1), _bytes(split, 3), _bytes(allowed, 1))
    return found if found.needed <= found.allowed else None


def older_negative_tpot(lat: Dict[str, Any]) -> bool:
    """A record made before TTFT was stamped inside each timed call took its TTFT from other calls than its e2e;
    where that TTFT exceeded the e2e, its TPOT is negative and no TPOT at all."""
    return "ttft_s" not in lat and ((lat.get("tpot") or {}).get("min") or 0) < 0
