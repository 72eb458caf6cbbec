"""Packed vs sequential: the same jobs of a sweep run one by one and under `launcher.pack=true`, compared
from their result.json files.

Compared (must agree within TOLERANCE): each rank's own memory figures, which do not depend on what runs
beside it when every job has GPUs of its own: the weights on its device after init, its device's peak
(NVML: the whole GPU, which only this job uses), torch's allocator peaks and its process's host RSS and
anonymous-memory peaks. Shown, not compared: phase times (packed jobs share the host's disks, memory
bandwidth and, under launcher.pack=true, each has only its GPUs' share of the CPUs) and node-wide figures
(they hold every job running at the time; see dsexp.packing.node_shared).
"""

from __future__ import annotations

import copy
import json
from collections import defaultdict
from typing import Any, Dict, List, Optional, Tuple

from dsexp.core.records import PHASES
from dsexp.core.result import JobRecord, Phase, RankRecord

TOLERANCE = 0.02
# figure -> (section of a phase record, key); the figure is the largest value over the phases
FIGURES = {
    "weights_device": (None, "weights_device"),
    "gpu_peak_nvml": ("peaks", "nvml_device_used_peak"),
    "gpu_alloc_peak": ("gpu", "gpu_alloc_peak"),
    "gpu_reserved_peak": ("gpu", "gpu_reserved_peak"),
    "host_rss_peak": ("peaks", "host_rss_peak"),
    "host_anon_peak": ("peaks", "host_anon_peak"),
}


def rank_figures(rank: RankRecord) -> Dict[str, Optional[float]]:
    """A rank's figures of FIGURES (bytes), None where the rank did not record one (e.g. GPU figures on CPU)."""
    out = {}
    for name, (section, key) in FIGURES.items():
        phases = [rank.phase(p) for p in Phase if rank.phase(p).recorded]
        vals = [(ph.raw if section is None else ph.raw.get(section) or {}).get(key) for ph in phases]
        vals = [v for v in vals if v is not None]
        out[name] = max(vals) if vals else None
    return out


def job_key(result: Dict[str, Any]) -> str:
    """The job's configuration without launcher.pack: equal for the two runs of one job."""
    config = copy.deepcopy(result["config"])
    (config.get("launcher") or {}).pop("pack", None)
    return json.dumps(config, sort_keys=True)


def pair_jobs(seq: List[Dict[str, Any]], packed: List[Dict[str, Any]]) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """(sequential, packed) result of each job, matched by configuration; both sweeps must hold the same jobs."""
    waiting = defaultdict(list)
    for res in packed:
        waiting[job_key(res)].append(res)
    pairs = []
    for res in seq:
        same = waiting.get(job_key(res))
        if not same:
            raise ValueError(f"job {res.get('job_dir')} has no counterpart in the packed sweep")
        pairs.append((res, same.pop(0)))
    left = [r.get("job_dir") for rs in waiting.values() for r in rs]
    if left:
        raise ValueError(f"packed jobs without a sequential counterpart: {left}")
    return pairs


def _label(result: Dict[str, Any]) -> str:
    c = result["config"]
    return c.get("variant") or result.get("job_dir", "?").rstrip("/").rsplit("/", 1)[-1]


def compare_figures(pairs: List[Tuple[Dict[str, Any], Dict[str, Any]]]) -> Dict[str, Dict[str, Any]]:
    """Per figure, the largest relative difference packed vs sequential over all jobs and ranks, and where."""
    out: Dict[str, Dict[str, Any]] = {}
    for s, p in pairs:
        ranks_s, ranks_p = JobRecord.of(s).ranks, JobRecord.of(p).ranks
        if len(ranks_s) != len(ranks_p):
            raise ValueError(f"{_label(s)}: {len(ranks_s)} ranks sequential, {len(ranks_p)} packed")
        for rs, rp in zip(ranks_s, ranks_p):
            fs, fp = rank_figures(rs), rank_figures(rp)
            for name, a in fs.items():
                b = fp[name]
                if a is None or b is None:
                    continue
                diff = abs(b - a) / a if a else float(b != a)
                cur = out.setdefault(name, {"max_rel_diff": -1.0})
                if diff > cur["max_rel_diff"]:
                    cur.update(max_rel_diff=diff, where=f"{_label(s)} rank {rs.rank}", sequential=a, packed=b)
    for v in out.values():
        v["within_tolerance"] = v["max_rel_diff"] <= TOLERANCE
    return out


def span_s(results: List[Dict[str, Any]]) -> Optional[float]:
    """Seconds from the first job's start to the last job's logged result (None without the job clocks)."""
    clocks = [r.get("clock") or {} for r in results]
    if not all("task" in c and "tracked" in c for c in clocks):
        return None
    return max(c["tracked"] for c in clocks) - min(c["task"] for c in clocks)


def mean_phase_s(results: List[Dict[str, Any]]) -> Dict[str, float]:
    """Mean over jobs of each phase's wall time (slowest rank)."""
    ran = [p for p in PHASES if all(JobRecord.of(r).ranks[0].phase(p).recorded for r in results)]  # quantize: quant=
    slowest = [{p: max(rk.phase(p).wall_s for rk in JobRecord.of(r).ranks) for p in ran} for r in results]
    return {p: sum(s[p] for s in slowest) / len(results) for p in ran}


def compare(seq: List[Dict[str, Any]], packed: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The comparison of two finished sweeps of the same jobs (every job ok)."""
    bad = [r.get("job_dir") for r in seq + packed if r.get("status") != "ok"]
    if bad:
        raise ValueError(f"jobs failed: {bad}")
    pairs = pair_jobs(seq, packed)
    names = {r["job_dir"].rstrip("/").rsplit("/", 1)[-1]: _label(r) for r in packed}
    spans = {"sequential": span_s(seq), "packed": span_s(packed)}
    figures = compare_figures(pairs)
    return {
        "jobs": len(pairs),
        "span_s": spans,
        "ratio": spans["packed"] / spans["sequential"] if all(spans.values()) else None,
        "placement": {
            _label(p): {
                "gpus": (p.get("packed") or {}).get("gpus"),
                "cpus": len((p.get("packed") or {}).get("cpus") or []) or None,
                "waited_s": (p.get("packed") or {}).get("waited_s"),
                "overlapped_with": [names.get(j, j) for j in (p.get("packed") or {}).get("overlapped_with") or []],
            }
            for _, p in pairs
        },
        "figures": figures,
        "all_within_tolerance": bool(figures) and all(v["within_tolerance"] for v in figures.values()),
        "phase_s": {"sequential": mean_phase_s(seq), "packed": mean_phase_s(packed)},
    }


def render(data: Dict[str, Any], title: str = "Packed vs sequential") -> str:
    """Markdown of compare()'s output (with optional `wall_s` {sequential, packed} timed around the sweeps)."""
    out = [f"# {title}", ""]
    if data.get("setup"):
        out += [data["setup"], ""]
    for what, times in (
        ("wall time of the sweep command", data.get("wall_s")),
        ("first job start to last job logged", data.get("span_s")),
    ):
        if times and all(times.values()):
            out.append(
                f"- {what}: sequential {times['sequential']:.1f} s, packed {times['packed']:.1f} s -> "
                f"ratio packed / sequential **{times['packed'] / times['sequential']:.2f}**"
            )
    out += ["", "| job | GPUs | CPUs | waited s | ran beside |", "| --- | --- | --- | --- | --- |"]
    for job, p in data["placement"].items():
        out.append(
            f"| {job} | {p['gpus']} | {p['cpus'] or 'all'} | {p['waited_s']} | "
            f"{', '.join(p['overlapped_with']) or '-'} |"
        )
    out += [
        "",
        f"Per-rank memory figures (largest difference over {data['jobs']} jobs and their ranks; "
        f"target within {100 * TOLERANCE:g}%):",
        "",
        "| figure | max rel. diff | where | sequential (bytes) | packed (bytes) | within |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name, v in data["figures"].items():
        out.append(
            f"| {name} | {100 * v['max_rel_diff']:.3f}% | {v['where']} | {v['sequential']:.6g} | "
            f"{v['packed']:.6g} | {'yes' if v['within_tolerance'] else 'NO'} |"
        )
    out += [
        "",
        "Phase times (mean over jobs of the slowest rank, s), shown not compared:",
        "",
    ]
    phases = list(next(iter(data["phase_s"].values()), {}))  # the phases every job recorded
    out += ["| run | " + " | ".join(phases) + " |", "| --- |" + " --- |" * len(phases)]
    for run, t in data["phase_s"].items():
        out.append(f"| {run} | " + " | ".join(f"{t[p]:.2f}" for p in phases) + " |")
    return "\n".join(out) + "\n"
