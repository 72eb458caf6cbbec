"""What PyTorch memory snapshots cost a job (campaign shared, sweep autotp2): the same job with
probe.memory_snapshot=false and true, side by side. Usage: python benchmarks/snapshot_cost.py SWEEP_DIR OUT_STEM ->
OUT_STEM.json, OUT_STEM.md

Per job: wall time, each phase's wall time (slowest rank), the time between phases (where the dumps happen: start
to the end of the last phase, minus the phases), per rank and phase the snapshot's size, events and dump time (or
why it was skipped), the memory series' size per rank and the sampler thread's share of a core per rank (on a GPU it
also reads NVML and the allocator for the series: the GPU figure for make bench's CPU one)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List

from dsexp.analysis.sources import results_from_dir

PHASES = ("start", "load", "init", "generate")


def job(r: Dict[str, Any]) -> Dict[str, Any]:
    ranks = [rk for rk in r.get("ranks") or [] if rk]
    phase_s = {p: max((rk["phases"].get(p) or {}).get("wall_s") or 0 for rk in ranks) for p in PHASES}
    between = max((between_phases(rk) for rk in ranks), default=0)
    snaps = [
        {"rank": rk["rank"], "phase": p, **(rk["phases"].get(p) or {}).get("memory_snapshot", {})}
        for rk in ranks
        for p in PHASES
        if (rk["phases"].get(p) or {}).get("memory_snapshot")
    ]
    return {
        "job_dir": r.get("job_dir"),
        "memory_snapshot": (r.get("config") or {}).get("probe", {}).get("memory_snapshot"),
        "status": r.get("status"),
        "cause": (r.get("failure") or {}).get("cause"),
        "wall_s": r.get("wall_s"),
        "phase_s": phase_s,
        "between_phases_s": between,
        "gpu_peak_gib": (r.get("headline") or {}).get("gpu_peak_gib"),
        "snapshots": snaps,
        "snapshot_bytes": sum(s.get("bytes", 0) for s in snaps),
        "dump_s": max((sum(s.get("dump_s", 0) for s in snaps if s["rank"] == rk["rank"]) for rk in ranks), default=0),
        "sampler_core_pct": [sampler_share(rk) for rk in ranks],
        "series_bytes": [s["bytes"] for s in r.get("series") or [] if s],
        "series_points": [len(s["points"]) for s in r.get("series") or [] if s],
        "trace_bytes": (Path(r["job_dir"]) / "trace.json").stat().st_size
        if (Path(r["job_dir"]) / "trace.json").is_file()
        else None,
    }


def sampler_share(rk: Dict[str, Any]) -> float:
    """% of a core the rank's sampler thread took over its life (NVML, the allocator and the series included)."""
    life = (rk.get("clock") or {}).get("finished", 0) - (rk.get("clock") or {}).get("t0", 0)
    return 100 * (rk.get("sampler") or {}).get("cpu_s", 0) / life if life > 0 else float("nan")


def between_phases(rk: Dict[str, Any]) -> float:
    """Seconds of the rank's life up to its last phase's end spent outside phases (barriers, probes, dumps)."""
    return rk["timeline"][-1]["t1"] - sum(e["t1"] - e["t0"] for e in rk["timeline"]) if rk.get("timeline") else 0.0


def markdown(jobs: List[Dict[str, Any]]) -> str:
    out = [
        "| snapshots | status | job wall s | start s | load s | init s | generate s | between phases s | dumps s "
        "(slowest rank) | snapshot MB | GPU peak GiB | series KB per rank | sampler % of a core per rank |",
        "|" + "---|" * 13,
    ]
    for j in jobs:
        p = j["phase_s"]
        out.append(
            f"| {j['memory_snapshot']} | {j['status']}{'' if not j['cause'] else ' (' + j['cause'] + ')'} "
            f"| {j['wall_s']:.1f} | {p['start']:.1f} | {p['load']:.2f} | {p['init']:.2f} | {p['generate']:.2f} "
            f"| {j['between_phases_s']:.2f} | {j['dump_s']:.2f} | {j['snapshot_bytes'] / 1e6:.1f} "
            f"| {j['gpu_peak_gib'] or float('nan'):.2f} | {', '.join(f'{b / 1e3:.0f}' for b in j['series_bytes'])} "
            f"| {', '.join(f'{x:.2f}' for x in j['sampler_core_pct'])} |"
        )
    out += ["", "| rank | phase | file | MB | events | dump s | skipped |", "|---|---|---|---|---|---|---|"]
    for j in jobs:
        for s in j["snapshots"]:
            out.append(
                f"| {s['rank']} | {s['phase']} | {s.get('file', '-')} | {s.get('bytes', 0) / 1e6:.1f} "
                f"| {s.get('events', '-')} | {s.get('dump_s', 0):.2f} | {s.get('skipped') or s.get('error') or '-'} |"
            )
    return "\n".join(out) + "\n"


def main() -> int:
    sweep, stem = Path(sys.argv[1]), Path(sys.argv[2])
    jobs = [job(r) for r in results_from_dir(sweep)]
    stem.with_suffix(".json").write_text(json.dumps(jobs, indent=1))
    stem.with_suffix(".md").write_text(markdown(jobs))
    print(markdown(jobs))
    return 0 if jobs else 1


if __name__ == "__main__":
    sys.exit(main())
