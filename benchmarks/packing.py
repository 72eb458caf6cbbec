"""Packed vs sequential: the same independent jobs run one by one and packed onto the machine's GPUs.

    python benchmarks/packing.py [--jobs 4] [--tp 1] [--model small] [--out DIR] [--keep DIR]
    python benchmarks/packing.py --compare SEQUENTIAL_SWEEP PACKED_SWEEP [--out DIR]

A warm-up job fills the caches (checkpoint, tp=1 reference, MLflow store); then `--jobs` jobs that
differ only in their label (`variant=p1,p2,...`) run under Hydra's basic launcher (one at a time) and
again with `hydra/launcher=dsexp_local launcher.pack=true` (all started at once, each on GPUs of its
own). Reports the wall-time ratio packed / sequential and, per per-rank memory figure, the largest
relative difference between the two runs of a job (dsexp.analysis.packed; target within 2%). With
--compare, only the comparison of two finished sweeps. Writes packing.json and packing.md into --out
(default results/<machine>/); exits 1 if a figure is off by more than 2%. Needs at least 2 GPUs (jobs
packed on one GPU would share it); on CPU, DSEXP_FAKE_GPUS=2 gives the allocator two GPUs to hand out.
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
from typing import Any, Dict, List

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import ROOT, dsexp, machine_name, results  # noqa: E402

from dsexp.analysis.packed import compare, render  # noqa: E402
from dsexp.job.cluster.packing import gpu_pool  # noqa: E402


def timed_sweep(args: List[str], workdir: Path, name: str) -> float:
    t = time.perf_counter()
    dsexp([*args, f"hydra.sweep.dir=multirun/{name}"], workdir, workdir / f"{name}.log")
    return time.perf_counter() - t


def run_both(args: argparse.Namespace) -> Dict[str, Any]:
    """Warm-up, then the sweep sequential and packed; the comparison with the two wall times."""
    job = ["-m", f"model={args.model}", f"tp={args.tp}"]
    variants = "variant=" + ",".join(f"p{i}" for i in range(1, args.jobs + 1))
    with tempfile.TemporaryDirectory(prefix="dsexp-packing-") as tmp:
        work = Path(tmp)
        try:
            timed_sweep([*job, "variant=warmup"], work, "warmup")
            walls = {
                "sequential": timed_sweep([*job, variants], work, "sequential"),
                "packed": timed_sweep(
                    [*job, variants, "hydra/launcher=dsexp_local", "launcher.pack=true"], work, "packed"
                ),
            }
            data = compare(results(work / "multirun" / "sequential"), results(work / "multirun" / "packed"))
        finally:
            if args.keep:
                shutil.copytree(work, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.pt"))
    data["wall_s"] = walls
    data["setup"] = (
        f"{args.jobs} jobs model={args.model} tp={args.tp} on GPUs [{','.join(gpu_pool())}], caches "
        "warm; sequential: Hydra's basic launcher; packed: hydra/launcher=dsexp_local launcher.pack=true."
    )
    return data


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=4)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--model", default="small")
    ap.add_argument(
        "--compare",
        nargs=2,
        type=Path,
        metavar=("SEQUENTIAL", "PACKED"),
        help="compare two finished sweep folders instead of running them",
    )
    ap.add_argument("--out", type=Path, help="folder for packing.json/.md (default results/<machine>/)")
    ap.add_argument("--keep", type=Path, help="copy the sweeps and logs here")
    args = ap.parse_args()
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    machine = machine_name()
    if args.compare:
        data = compare(results(args.compare[0]), results(args.compare[1]))
        data["setup"] = f"sweeps {args.compare[0]} (sequential) and {args.compare[1]} (packed)."
    else:
        pool = gpu_pool()
        if len(pool) < 2 * args.tp:
            print(
                f"packing needs at least {2 * args.tp} GPUs for two tp={args.tp} jobs at once; this machine has "
                f"{len(pool)} (on CPU set DSEXP_FAKE_GPUS=2)",
                file=sys.stderr,
            )
            return 2
        data = run_both(args)
    data.update(machine=machine, time=time.strftime("%Y-%m-%d %H:%M"))
    folder = args.out or ROOT / "results" / machine
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "packing.json").write_text(json.dumps(data, indent=1))
    text = render(data, f"Packed vs sequential on `{machine}`")
    (folder / "packing.md").write_text(text)
    print(text)
    return 0 if data["all_within_tolerance"] else 1


if __name__ == "__main__":
    sys.exit(main())
