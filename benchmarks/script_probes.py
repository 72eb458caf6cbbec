"""Benchmark (not a test) with its targets: what dsexp's probes add to a user's script, per rank.

The same script (a user's AutoTP inference script, tests/helpers/user_scripts.py: zero_autotp.py, on model=small)
is started by torchrun exactly as its user would, at tp=2 on the CPU accelerator, alternately as written and with
dsexp's bootstrap on the ranks' PYTHONPATH (the hooks, the phase recorder, the 10 ms sampler and the memory series,
as a script job runs them). Measured: the launch's wall time, and the largest rank's peak RSS (the launcher's
RUSAGE_CHILDREN). Targets: <= 2% wall time, <= 50 MiB per rank.

Usage: python benchmarks/script_probes.py [--pairs 4] [--out results/cpu/script_probes.md]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "tests"))

from dsexp.compose.config import compose_app, to_schema  # noqa: E402
from dsexp.core.protocol import SCRIPT_ENV, SCRIPT_JOB_ENV, bootstrap_dir, write_job_file  # noqa: E402
from dsexp.job.run import prepare_model  # noqa: E402

from helpers.user_scripts import write_script  # noqa: E402

WALL_TARGET, RSS_TARGET_MIB = 0.02, 50


def run_once(script: Path, job: Path, probed: bool) -> dict:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    if probed:
        env.update(
            PYTHONPATH=os.pathsep.join([str(bootstrap_dir()), env.get("PYTHONPATH", "")]),
            **{SCRIPT_JOB_ENV: str(job), SCRIPT_ENV: str(script)},
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", str(script)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=script.parent)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(proc.stderr[-2000:])
    # ru_maxrss of children is a running maximum: each run uses a fresh benchmark process for an honest figure
    return {"wall_s": wall, "maxrss_kib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "before": before}


def one(mode: str, folder: Path) -> dict:
    """Run one launch in a fresh interpreter (its RUSAGE_CHILDREN starts at zero)."""
    out = subprocess.run(
        [sys.executable, __file__, "--one", mode, "--folder", str(folder)], capture_output=True, text=True
    )
    if out.returncode:
        raise RuntimeError(out.stderr[-2000:])
    wall, rss = out.stdout.split()[-2:]
    return {"wall_s": float(wall), "rss_mib": int(rss) / 1024}


def prepare(folder: Path) -> None:
    spec = to_schema(compose_app([f"cache_dir={folder / 'cache'}", "model=small"]))
    model_dir = prepare_model(spec)["model_dir"]
    script = write_script(folder, "zero_autotp.py", model_dir)
    job = folder / "job"
    (job / "ranks").mkdir(parents=True, exist_ok=True)
    spec = to_schema(compose_app([f"script.path={script}", "check.correctness=false"]))
    write_job_file(job, spec, {"device": "cpu", "workload": "script", "script": {"path": str(script)}})
    assert asdict(spec)["script"]["path"]


def _each(runs, key: str, nd: int) -> str:
    return ", ".join(f"{r[key]:.{nd}f}" for r in runs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=4)
    ap.add_argument("--out")
    ap.add_argument("--one", choices=("plain", "probed"))
    ap.add_argument("--folder")
    args = ap.parse_args(argv)
    if args.one:
        folder = Path(args.folder)
        r = run_once(folder / "zero_autotp.py", folder / "job", args.one == "probed")
        print(f"{r['wall_s']:.4f} {r['maxrss_kib']}")
        return 0
    folder = Path(tempfile.mkdtemp(prefix="dsexp-probes-"))
    prepare(folder)
    one("plain", folder)  # warm the page cache and the imports once
    runs = {"plain": [], "probed": []}
    for i in range(args.pairs):  # alternated, half of the pairs probed first
        order = ("plain", "probed") if i % 2 == 0 else ("probed", "plain")
        for mode in order:
            runs[mode].append(one(mode, folder))
    ratio = statistics.median(b["wall_s"] / a["wall_s"] for a, b in zip(runs["plain"], runs["probed"]))
    rss = statistics.median(b["rss_mib"] - a["rss_mib"] for a, b in zip(runs["plain"], runs["probed"]))
    lines = [
        "# What dsexp's probes add to a user's script (CPU, tp=2, model=small, zero_autotp.py)",
        "",
        "| run | wall s (each) | largest rank's peak RSS MiB (each) |",
        "|---|---|---|",
        *(f"| {mode} | {_each(rs, 'wall_s', 2)} | {_each(rs, 'rss_mib', 0)} |" for mode, rs in runs.items()),
        "",
        f"- wall time: x{ratio:.3f} (median of {args.pairs} alternated pairs): target <= +{WALL_TARGET:.0%}: "
        + ("met" if ratio - 1 <= WALL_TARGET else "not met"),
        f"- peak RSS per rank: {rss:+.0f} MiB (median difference): target <= {RSS_TARGET_MIB} MiB: "
        + ("met" if rss <= RSS_TARGET_MIB else "not met"),
        "",
        "The probed runs include everything a script job puts in a rank: the bootstrap, the post-import hooks, the "
        "phase recorder with its 10 ms sampler and memory series, and the record written after every phase.",
    ]
    text = "\n".join(lines) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
