"""CPU benchmark: host peak per rank while loading, eager-with-conversion vs sharded (and meta), tp=2.

    PYTHONPATH=src .venv/bin/python benchmarks/host_peak_loading.py

Runs `python -m dsexp -m load=... model=small model.dtype=fp32 dtype=bf16 tp=2` (a ~610 MB fp32
checkpoint converted to bf16 on load), then reads each job's result.json. The figure compared is
each rank's host RSS peak over the load and init phases as the sampler caught it (anonymous and
file-backed reported apart); the ratio is sharded / eager of the worst rank. Not a test: numbers are
noisy on a shared machine, so nothing is asserted. Writes results/cpu/host_peak_loading.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
LOAD_PHASES = ("load", "init")


def run_sweep(loads: str, workdir: Path, extra: list) -> Path:
    sweep = workdir / "multirun" / "host_peak"
    args = [
        sys.executable,
        "-m",
        "dsexp",
        "-m",
        f"load={loads}",
        "model=small",
        "model.dtype=fp32",
        "dtype=bf16",
        "tp=2",
        f"hydra.sweep.dir={sweep}",
        *extra,
    ]
    subprocess.run(args, cwd=workdir, check=True)
    return sweep


def rank_figures(rank: dict) -> dict:
    phases = rank["phases"]
    peak = lambda q: max(phases[p]["peaks"].get(f"{q}_peak", 0) for p in LOAD_PHASES) / GIB  # noqa: E731
    return {
        "rank": rank["rank"],
        "rss_peak_gib": peak("host_rss"),
        "anon_peak_gib": peak("host_anon"),
        "file_peak_gib": peak("host_file"),
        "start_rss_gib": phases["start"]["host"]["host_rss"] / GIB,
        "end_rss_gib": max(phases[p]["host"]["host_rss"] for p in LOAD_PHASES) / GIB,  # snapshots miss transients
        "start_anon_gib": phases["start"]["host"]["host_anon"] / GIB,
        "weights_gib": phases["init"]["weights_device"] / GIB,
    }


def summarise(res: dict) -> dict:
    ranks = [rank_figures(r) for r in res["ranks"]]
    return {
        "load": res["config"]["load"]["name"],
        "status": res["status"],
        "conversion": res["runtime"].get("conversion"),
        "split": res["runtime"].get("split"),
        "ranks": ranks,
        "rss_peak_gib": max(r["rss_peak_gib"] for r in ranks),
        "anon_peak_gib": max(r["anon_peak_gib"] for r in ranks),
        "anon_above_start_gib": max(r["anon_peak_gib"] - r["start_anon_gib"] for r in ranks),
        "node_peak_gib": res["headline"].get("node_host_peak_gib"),
        "load_s": res["headline"].get("load_s"),
        "init_s": res["headline"].get("init_s"),
        "logits_rel_err": (res.get("correctness") or {}).get("logits_rel_err"),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--loads", default="eager,meta,sharded", help="load= options to run (eager and sharded needed)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "cpu" / "host_peak_loading.json")
    ap.add_argument("overrides", nargs="*", help="extra Hydra overrides")
    args = ap.parse_args()
    os.environ.setdefault("PYTHONPATH", str(ROOT / "src"))
    with tempfile.TemporaryDirectory(prefix="dsexp-bench-") as tmp:
        sweep = run_sweep(args.loads, Path(tmp), args.overrides)
        results = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/result.json"))]
    rows = {s["load"]: s for s in map(summarise, results)}
    eager, sharded = rows.get("eager"), rows.get("sharded")
    ratio = sharded["rss_peak_gib"] / eager["rss_peak_gib"] if eager and sharded else None
    anon_ratio = sharded["anon_above_start_gib"] / eager["anon_above_start_gib"] if eager and sharded else None
    print(
        f"{'load':8} {'status':6} {'conversion':11} {'rss_peak':>9} {'anon_peak':>10} {'anon_dload':>10} "
        f"{'node_peak':>9} {'rel_err':>8}   (GiB, worst rank, load+init phases)"
    )
    for s in rows.values():
        print(
            f"{s['load']:8} {s['status']:6} {str(s['conversion']):11} {s['rss_peak_gib']:9.3f} "
            f"{s['anon_peak_gib']:10.3f} {s['anon_above_start_gib']:10.3f} {s['node_peak_gib']:9.3f} "
            f"{s['logits_rel_err'] or float('nan'):8.4f}"
        )
    if ratio is not None:
        print(
            f"host peak per rank, sharded / eager-with-conversion: {ratio:.2f} (target <= 0.6); "
            f"anonymous memory added while loading: {anon_ratio:.2f}"
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(
        json.dumps(
            {
                "benchmark": "host_peak_loading",
                "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                "setup": "model=small (fp32 on disk, ~610 MB) dtype=bf16 tp=2, CPU accelerator (gloo)",
                "ratio_rss_sharded_over_eager": ratio,
                "ratio_anon_added_sharded_over_eager": anon_ratio,
                "target": 0.6,
                "runs": rows,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
