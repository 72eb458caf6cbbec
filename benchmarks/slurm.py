"""`make bench` (or `make bench-slurm`): how long SLURM takes from submission to the start of each dsexp job.

    python benchmarks/slurm.py [--jobs N] [--machine NAME] [--out DIR] [--keep DIR]

Starts a throwaway one-node SLURM cluster (tests/helpers/slurm_cluster.py: munged, slurmctld, slurmd from a temp
folder, stopped at the end), runs `python -m dsexp -m hydra/launcher=dsexp_slurm tp=1 model=tiny variant=...`
with N jobs (one array; each job asks for the node's 2 CPUs, so they run one after another) and reports per
job what dsexp records in `result.json["slurm"]`:

- SLURM's SubmitTime -> StartTime (whole seconds, SLURM's clock), which includes waiting for the job before;
- free -> start: the previous job's EndTime -> this job's StartTime (the scheduler's own latency once the node
  is free), whole seconds;
- sbatch -> batch start: the sweep process's sbatch call -> the first line of the batch script on the node
  (`DSEXP_SLURM_STARTED`), sub-second;
- sbatch -> dsexp job code: -> `clock.task`, when Hydra hands the job to dsexp inside submitit's process
  (Python, submitit and Hydra have started by then).

Writes results/<machine>/slurm_bench.{json,md} (machine: `cpu` by default). Skips cleanly, exit 0, where SLURM
is not installed or this is not root (slurmd runs jobs as their user). Not a test: nothing is asserted.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsexp.analysis.sources import results_from_dir  # noqa: E402


def cluster_script():
    spec = importlib.util.spec_from_file_location("slurm_cluster", ROOT / "tests" / "helpers" / "slurm_cluster.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["slurm_cluster"] = module
    spec.loader.exec_module(module)
    return module


def skip_reason(sc) -> Optional[str]:
    missing = sc.missing_binaries()
    if missing:
        return f"SLURM not installed ({' '.join(missing)} missing; .ci/install-slurm.sh installs it)"
    if os.geteuid() != 0:
        return "needs root (slurmd runs jobs as their user)"
    return None


def free_port(sc, base: int = 18817) -> int:
    return next(p for p in range(base, base + 2000, 100) if not any(sc._port_taken(q) for q in (p, p + 1)))


def seconds(values: List[float]) -> Dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)} if values else {}


def bench(sc, work: Path, jobs: int) -> Dict[str, Any]:
    t0 = time.perf_counter()
    with sc.start_cluster(work / "cluster", nodes=1, port=free_port(sc)) as cluster:
        up_s = time.perf_counter() - t0
        version = cluster.run("sinfo", "--version", check=False).stdout.strip()  # needs the cluster's config
        variants = ",".join(f"v{i}" for i in range(jobs))
        args = ["-m", "hydra/launcher=dsexp_slurm", "tp=1", "model=tiny", f"variant={variants}", "hydra.sweep.dir=sw"]
        env = {**os.environ, **cluster.env_vars, "DSEXP_CACHE": str(work / "cache"), "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
        env.pop("MLFLOW_TRACKING_URI", None)
        t1 = time.perf_counter()
        with open(work / "dsexp.log", "w") as log:
            proc = subprocess.run(
                [sys.executable, "-m", "dsexp", *args, f"tracking.uri=sqlite:///{work / 'mlflow.db'}"],
                cwd=work,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        sweep_s = time.perf_counter() - t1
        if proc.returncode:
            raise RuntimeError(f"the sweep failed ({proc.returncode}):\n{(work / 'dsexp.log').read_text()[-3000:]}")
        from dsexp.job.cluster.slurm import epoch

        rows, previous_end = [], None
        for res in sorted(results_from_dir(work / "sw"), key=lambda r: epoch((r.get("slurm") or {}).get("start_time"))):
            s = res.get("slurm") or {}
            start, end = epoch(s.get("start_time")), epoch(s.get("end_time"))
            rows.append(
                {
                    "job": Path(res["job_dir"]).name,
                    "slurm_job": s.get("job_id"),
                    "status": res["status"],
                    "state": s.get("state"),
                    "submit_to_start_s": s.get("submit_to_start_s"),
                    "free_to_start_s": None
                    if previous_end is None or start is None
                    else max(0.0, start - previous_end),
                    "sbatch_to_start_s": s.get("sbatch_to_start_s"),
                    "sbatch_to_task_s": s.get("sbatch_to_task_s"),
                    "job_wall_s": res.get("wall_s"),
                    "cache": (res.get("runtime") or {}).get("cache"),
                }
            )
            previous_end = end
    return {
        "slurm": version,
        "cluster_up_s": up_s,
        "sweep_s": sweep_s,
        "jobs": rows,
        "summary": {
            k: seconds([r[k] for r in rows if r[k] is not None])
            for k in ("submit_to_start_s", "free_to_start_s", "sbatch_to_start_s", "sbatch_to_task_s")
        },
    }


def fmt(v: Any, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def render(data: Dict[str, Any]) -> str:
    out = [
        f"# SLURM submit-to-start ({data['machine']}, {data['time']})",
        "",
        f"`python benchmarks/slurm.py`: a throwaway one-node cluster ({data['slurm'] or 'SLURM'}, up in "
        f"{data['cluster_up_s']:.1f} s), then `python -m dsexp -m hydra/launcher=dsexp_slurm tp=1 model=tiny` "
        f"with {len(data['jobs'])} jobs in one array, each asking for the node's CPUs, so they run one after "
        f"another (the sweep took {data['sweep_s']:.1f} s). SLURM's times are whole seconds.",
        "",
        "| job | SLURM job | state | submit -> start (SLURM) | previous job's end -> start (SLURM) "
        "| sbatch -> batch start (dsexp) | sbatch -> dsexp job code | job wall |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in data["jobs"]:
        out.append(
            f"| {r['job']} | {r['slurm_job']} | {r['state']} | {fmt(r['submit_to_start_s'], 0)} s "
            f"| {fmt(r['free_to_start_s'], 0)} s | {fmt(r['sbatch_to_start_s'])} s | {fmt(r['sbatch_to_task_s'])} s "
            f"| {fmt(r['job_wall_s'], 1)} s |"
        )
    s = data["summary"]
    first = data["jobs"][0] if data["jobs"] else {}
    out += [
        "",
        f"- On an idle node the first job started {fmt(first.get('sbatch_to_start_s'))} s after the sbatch call "
        f"(SLURM: {fmt(first.get('submit_to_start_s'), 0)} s), and dsexp's job code ran "
        f"{fmt(first.get('sbatch_to_task_s'))} s after it.",
        f"- Once the node was free, SLURM started the next job after {fmt(s['free_to_start_s'].get('min'), 0)}-"
        f"{fmt(s['free_to_start_s'].get('max'), 0)} s (median {fmt(s['free_to_start_s'].get('median'), 0)} s; "
        "slurm.conf here: sched_interval=5, bf_interval=5; a job ending also triggers a scheduling pass).",
        "- From the batch script's first line to dsexp's job code: "
        + ", ".join(
            fmt(r["sbatch_to_task_s"] - r["sbatch_to_start_s"])
            for r in data["jobs"]
            if r["sbatch_to_task_s"] is not None and r["sbatch_to_start_s"] is not None
        )
        + " s (srun, then Python importing submitit, Hydra composing the job's config).",
    ]
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4, help="jobs in the sweep (one array)")
    ap.add_argument("--machine", default="cpu", help="results/<machine>/")
    ap.add_argument("--out", type=Path, default=ROOT / "results", help="results root")
    ap.add_argument("--keep", type=Path, help="copy the benchmark's folder (sweep, logs) here")
    args = ap.parse_args()
    sc = cluster_script()
    folder = args.out / args.machine
    data: Dict[str, Any] = {"machine": args.machine, "time": time.strftime("%Y-%m-%d %H:%M")}
    reason = skip_reason(sc)
    if reason:
        print(f"benchmarks/slurm.py: skipped: {reason}")
        return 0
    with tempfile.TemporaryDirectory(prefix="dsexp-bench-slurm-") as tmp:
        try:
            data.update(bench(sc, Path(tmp), args.jobs))
        finally:
            if args.keep:
                shutil.copytree(tmp, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.safetensors"))
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "slurm_bench.json").write_text(json.dumps(data, indent=1))
    text = render(data)
    (folder / "slurm_bench.md").write_text(text + "\n")
    print(text)
    print(f"\nwrote {folder / 'slurm_bench.json'} and slurm_bench.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
