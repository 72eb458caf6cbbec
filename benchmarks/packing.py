"""Packed vs sequential: the same independent jobs run one by one and packed onto the machine's GPUs.

    python benchmarks/packing.py [--jobs 4] [--tp 1] [--model small] [--out DIR] [--keep DIR]

A warm-up job fills the caches (checkpoint, tp=1 reference, MLflow store); then `--jobs` jobs that
differ only in their label (`variant=p1,p2,...`) run under Hydra's basic launcher (one at a time) and
again with `hydra/launcher=dsexp_local launcher.pack=true` (all started at once, each on GPUs of its
own). Reports the wall-time ratio packed / sequential and, per figure, the largest relative difference
between the two runs of a job over all jobs and ranks: weights on the device after init, GPU peak
(NVML and torch's allocator), the rank's host RSS peak; the target is within 2%. Phase times are shown,
not compared: jobs packed on one host share its CPUs. Writes packing.json and packing.md into --out
(default results/<machine>/). On CPU, DSEXP_FAKE_GPUS=2 gives the allocator two GPUs to hand out.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from run import ROOT, dsexp, machine_name, results  # noqa: E402

TOLERANCE = 0.02
PHASES = ("start", "load", "init", "generate")


def rank_figures(rank: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """Per-rank figures that must not depend on other jobs running beside this one."""
    phases = rank["phases"]

    def peak(section: str, key: str) -> Optional[float]:
        vals = [(phases[p].get(section) or {}).get(key) for p in PHASES if p in phases]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    return {"weights_device": phases["init"]["weights_device"], "gpu_peak_nvml": peak("peaks", "nvml_device_used_peak"),
            "gpu_alloc_peak": peak("gpu", "gpu_alloc_peak"), "host_rss_peak": peak("peaks", "host_rss_peak")}


def compare(seq: List[Dict[str, Any]], packed: List[Dict[str, Any]]) -> Dict[str, Dict[str, Any]]:
    """Largest relative difference per figure over jobs (matched by variant) and ranks."""
    by_variant = {r["config"]["variant"]: r for r in packed}
    out: Dict[str, Dict[str, Any]] = {}
    for s in seq:
        p = by_variant[s["config"]["variant"]]
        for rs, rp in zip(s["ranks"], p["ranks"]):
            fs, fp = rank_figures(rs), rank_figures(rp)
            for name, a in fs.items():
                b = fp[name]
                if a is None or b is None:
                    continue
                diff = abs(b - a) / a if a else float(b != a)
                cur = out.setdefault(name, {"max_rel_diff": 0.0, "where": None})
                if diff >= cur["max_rel_diff"]:
                    cur.update(max_rel_diff=diff, where=f"{s['config']['variant']} rank {rs['rank']}", seq=a, packed=b)
    for v in out.values():
        v["within_tolerance"] = v["max_rel_diff"] <= TOLERANCE
    return out


def timed_sweep(args: List[str], workdir: Path, name: str) -> float:
    t = time.perf_counter()
    dsexp([*args, f"hydra.sweep.dir=multirun/{name}"], workdir, workdir / f"{name}.log")
    return time.perf_counter() - t


def render(data: Dict[str, Any]) -> str:
    out = [f"# Packed vs sequential on `{data['machine']}`", "", f"{data['time']} · {data['setup']}", "",
           f"- wall time: sequential {data['sequential_s']:.1f} s, packed {data['packed_s']:.1f} s -> "
           f"**ratio packed / sequential {data['ratio']:.2f}**",
           f"- GPUs handed out: {data['gpus_by_job']}; jobs that overlapped: {data['overlaps']}", "",
           "| figure (per rank) | max rel. diff | where | sequential | packed | within 2% |", "| --- | --- | --- | --- | --- | --- |"]
    for name, v in data["figures"].items():
        out.append(f"| {name} | {100 * v['max_rel_diff']:.3f}% | {v['where']} | {v['seq']:.4g} | {v['packed']:.4g} | "
                   f"{'yes' if v['within_tolerance'] else 'NO'} |")
    out += ["", "Phase times (mean over jobs, s; packed jobs share the host's CPUs):", "",
            "| run | " + " | ".join(PHASES) + " |", "| --- |" + " --- |" * len(PHASES)]
    for run, t in data["phase_s"].items():
        out.append(f"| {run} | " + " | ".join(f"{t[p]:.2f}" for p in PHASES) + " |")
    return "\n".join(out) + "\n"


def mean_phases(jobs: List[Dict[str, Any]]) -> Dict[str, float]:
    return {p: sum(max(rk["phases"][p]["wall_s"] for rk in r["ranks"]) for r in jobs) / len(jobs) for p in PHASES}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--model", default="small")
    ap.add_argument("--out", type=Path, help="folder for packing.json/.md (default results/<machine>/)")
    ap.add_argument("--keep", type=Path, help="copy the sweeps and logs here")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    machine = machine_name()
    job = ["-m", f"model={args.model}", f"tp={args.tp}"]
    variants = "variant=" + ",".join(f"p{i}" for i in range(1, args.jobs + 1))
    with tempfile.TemporaryDirectory(prefix="dsexp-packing-") as tmp:
        work = Path(tmp)
        timed_sweep([*job, "variant=warmup"], work, "warmup")
        seq_s = timed_sweep([*job, variants], work, "sequential")
        packed_s = timed_sweep([*job, variants, "hydra/launcher=dsexp_local", "launcher.pack=true"], work, "packed")
        seq, packed = results(work / "multirun" / "sequential"), results(work / "multirun" / "packed")
        names = {Path(r["job_dir"]).name: r["config"]["variant"] for r in packed}
        if args.keep:
            shutil.copytree(work, args.keep, dirs_exist_ok=True)
    data = {"machine": machine, "time": time.strftime("%Y-%m-%d %H:%M"),
            "setup": f"{args.jobs} jobs model={args.model} tp={args.tp}, caches warm; sequential: Hydra's basic "
                     f"launcher; packed: hydra/launcher=dsexp_local launcher.pack=true",
            "sequential_s": seq_s, "packed_s": packed_s, "ratio": packed_s / seq_s,
            "gpus_by_job": {r["config"]["variant"]: r["packed"]["gpus"] for r in packed},
            "overlaps": {r["config"]["variant"]: [names[j] for j in r["packed"]["overlapped_with"]] for r in packed},
            "figures": compare(seq, packed),
            "phase_s": {"sequential": mean_phases(seq), "packed": mean_phases(packed)}}
    folder = args.out or ROOT / "results" / machine
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "packing.json").write_text(json.dumps(data, indent=1))
    (folder / "packing.md").write_text(render(data))
    print(render(data))
    return 0 if all(v["within_tolerance"] for v in data["figures"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
