"""dsexp's per-job overhead and its caches across a sweep (section `overhead` of `make bench`).

    python benchmarks/job_overhead.py [--overhead-jobs N] [--machine NAME] [--out DIR] [--keep DIR]

Identical `load=sharded` jobs (tiny; tp=2, or 1 on a machine of one GPU) under Hydra's basic launcher on the
benchmark's empty cache. The first computes the random-weight checkpoint, the tp=1 reference logits and the per-rank
split, the others must find all three (cache hits, reported with the seconds each miss took); each job's wall time is
split by dsexp.analysis.overhead (the ranks' own work, and every step around it). The first job also pays the sweep
process's one-time imports and is reported apart. Kept as the `overhead` section of results/<machine>/bench.json and
bench.md (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from common import dsexp, gpu_count, main_of, met, results, summary, table

from dsexp.analysis.overhead import DESCRIPTIONS, NOT_DSEXP, SEGMENTS, breakdown

SECTION = "overhead"
MODEL = "tiny"  # the jobs' model (sampler_on_off.py, run after this in one work folder, finds it cached)
TARGET_S = 3.0  # overhead dsexp adds, a job
CACHED = ("checkpoint", "reference", "split")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--overhead-jobs", type=int, default=4, help="overhead: jobs in the sweep (>= 2; the first is reported apart)"
    )


def run(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    tp = 1 if gpu_count() == 1 else 2  # 2 ranks (CPU processes or GPUs) where the machine has them
    return measure(work, tp, args.overhead_jobs, MODEL)


def measure(workdir: Path, tp: int, jobs: int, model: str) -> Dict[str, Any]:
    """A sweep of identical `load=sharded` jobs on the benchmark's empty cache: job 1 computes the checkpoint,
    the tp=1 reference and the per-rank split (and pays the sweep process's one-time imports): it is reported
    apart; the others must reuse all three, and their overhead is the steady per-job figure."""
    variants = ",".join(f"o{i}" for i in range(1, jobs + 1))
    t0 = time.time()
    dsexp(
        [
            "-m",
            f"model={model}",
            "load=sharded",
            f"tp={tp}",
            f"variant={variants}",
            "hydra.sweep.dir=multirun/overhead",
        ],
        workdir,
        workdir / "overhead.log",
    )
    t1 = time.time()
    done = results(workdir / "multirun" / "overhead")
    rows = [{"job": i + 1, **breakdown(res, done[i - 1] if i else None)} for i, res in enumerate(done)]
    steady = rows[1:]
    return {
        "setup": f"model={model} load=sharded tp={tp}, {len(done)} identical jobs (variant={variants}) under the basic "
        "launcher, on an empty cache",
        "jobs": rows,
        "steady": {k: summary([r[k] for r in steady if k in r]) for k in rows[-1] if k != "job"},
        "first_job_extra_s": (rows[0]["overhead_dsexp"] - rows[0]["prepare"])
        - statistics.mean(r["overhead_dsexp"] - r.get("hydra", 0) - r["prepare"] for r in steady),
        "sweep_start_s": done[0]["clock"]["task"] - t0,
        "sweep_end_s": t1 - done[-1]["clock"]["tracked"],
        "sweep_wall_s": t1 - t0,
        "cache": cache_use(done, rows),
    }


def cache_use(done: List[Dict[str, Any]], rows: List[Dict[str, Any]]) -> Dict[str, Any]:
    """Per job: hit or miss for each cached artefact, the seconds a miss took, the job's preparation time."""
    out = []
    for res, row in zip(done, rows):
        rt, split = res["runtime"], res["runtime"].get("split") or {}
        out.append(
            {
                "job": row["job"],
                **rt["cache"],
                "prepare_s": row["prepare"],
                "checkpoint_s": rt.get("checkpoint_write_s") if rt.get("checkpoint_written") else None,
                "reference_s": rt.get("reference_s"),
                "split_s": None if split.get("cache_hit") else split.get("seconds"),
            }
        )
    expected = [{k: "miss" if i == 0 else "hit" for k in CACHED} for i in range(len(out))]
    return {"jobs": out, "as_expected": [{k: r[k] for k in CACHED} for r in out] == expected}


def render(data: Dict[str, Any]) -> List[str]:
    ov = data[SECTION]
    st = ov["steady"]
    own, total = st["overhead_dsexp"]["mean"], st["overhead"]["mean"]
    out = [
        "## Per-job overhead",
        "",
        f"Setup: {ov['setup']}. Mean of jobs 2-{len(ov['jobs'])} (seconds); job 1 "
        "is in the JSON. Segments follow one another, so they add up to the job's wall time.",
        "",
    ]
    names = ["hydra"] + [n for n, *_ in SEGMENTS]
    desc = {"hydra": "Hydra between jobs: composing the next job's config, its folder and logging", **DESCRIPTIONS}
    out += table(
        ["segment", "s (mean)", "min", "max", "what"],
        [
            [
                n + (" (ranks' own work)" if n == "rank_work" else ""),
                f"{st[n]['mean']:.2f}",
                f"{st[n]['min']:.2f}",
                f"{st[n]['max']:.2f}",
                desc[n],
            ]
            for n in names
            if st.get(n)
        ],
    )
    verdict = met(own, TARGET_S, "s")
    out += [
        f"- wall time per job {st['total']['mean']:.2f} s, of which the ranks' own work "
        f"{st['rank_work']['mean']:.2f} s: overhead **{total:.2f} s**.",
        f"- overhead dsexp adds (all but {', '.join(NOT_DSEXP)}, which any torchrun + DeepSpeed job pays): "
        f"**{own:.2f} s** -> target <= {TARGET_S:.0f} s a job: {verdict}.",
        f"- the whole overhead incl. rank start-up against the same target: "
        f"{met(total, TARGET_S, 's')}; "
        f"rank start-up (a fresh interpreter importing torch and DeepSpeed) alone is "
        f"{st['rank_startup']['mean']:.2f} s, see Imports.",
        f"- once per sweep: start {ov['sweep_start_s']:.1f} s (interpreter, Hydra, validating every job, "
        f"MLflow parent run), end {ov['sweep_end_s']:.1f} s (table, report and plots); the first job of a "
        f"sweep process, cache work aside, took {ov['first_job_extra_s']:+.1f} s against the others (one-time "
        "imports of torch and MLflow in the Hydra process).",
        "",
    ]
    return out + render_cache(ov)


def render_cache(ov: Dict[str, Any]) -> List[str]:
    ca = ov.get("cache")
    if not ca:
        return []
    out = [
        "## Reuse across a sweep (caches)",
        "",
        f"The per-job overhead sweep ({ov['setup']}). hit: found and "
        "reused; miss: computed by this job (seconds it took).",
        "",
    ]

    def cell(r, k):
        return r[k] + (f" ({r[k + '_s']:.1f} s)" if r.get(k + "_s") is not None else "")

    out += table(
        ["job", "random-weight checkpoint", "tp=1 reference logits", "per-rank split", "preparation s"],
        [
            [r["job"], cell(r, "checkpoint"), cell(r, "reference"), cell(r, "split"), f"{r['prepare_s']:.2f}"]
            for r in ca["jobs"]
        ],
    )
    return out + [f"Computed once, then reused: {'yes' if ca['as_expected'] else 'NO (see the table)'}.", ""]


if __name__ == "__main__":
    sys.exit(main_of(__doc__, SECTION, add_arguments, run))
