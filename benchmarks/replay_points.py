"""Each point a one-load budget search measured, replayed through the caching allocator with the calls it made.

    make benchmark NAME=replay_points ARGS="results/h200/budget/gpu19_tp4_one_load"

A load's first point also makes the correctness check's logits call (dsexp.rank.workloads.pipeline.wants_logits: the
points before the first that ran), at the point's batch in the jobs committed before that call ran the first sequence
alone (their records say nothing of it), at the batch the point records (`logits_call`) since; the points after it make
the generate calls alone. This replays every measured point with its own calls (the busiest rank's model as
dsexp.predict.job traces it, under the cap the job ran with, with the allocator setting it ran) and sets its reserved
peak beside the rank's own (rank 0's `gpu_reserved_peak` in the point's phase). The trace is transformers' generate on
the meta device, so it depends on the transformers installed here: the table names it. Writes
results/cpu/replay_points_<folder>_tf<version>.{json,md}. Another transformers without another environment: install it
into a folder put first on the path, e.g. `pip install --no-deps --target /tmp/tf517 transformers==5.17.0
"huggingface-hub>=1.5,<2"` and `pip install --target /tmp/tf517 httpx`, then `PYTHONPATH=/tmp/tf517` (how the 5.17.0
tables were made: the version on the GPU machines' image).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def measured_points(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Rank 0's ok and out-of-memory points in the order they ran, each with whether it made the logits call, the
    ranks that ran out of memory there, and rank 0's reserved peak (where another rank ran out, rank 0's own)."""
    from dsexp.core.result import JobRecord

    rank = (result.get("ranks") or [{}])[0]
    phases, out, ran = rank.get("phases") or {}, [], False
    logits_batch = JobRecord(result).logits_batch  # one code, one way of making the call, for every point of a job
    for e in rank.get("points") or []:
        if e.get("status") not in ("ok", "oom"):
            continue
        gpu = (phases.get(e["phase"]) or {}).get("gpu") or {}
        out.append({"batch": e["batch"], "status": e["status"], "logits": not ran, "logits_batch": logits_batch,
                    "oom_ranks": e.get("oom_ranks"), "reserved_peak": gpu.get("gpu_reserved_peak")})  # fmt: skip
        ran = ran or e["status"] == "ok"
    return out


def replay_job(config: Dict[str, Any], points: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    from dsexp.engines.placement import RULES
    from dsexp.predict import fragmentation
    from dsexp.predict.job import Facts, outside, predict, replay_model

    pred = predict(config, RULES, Facts(device="cuda"))
    ranked, weights, why = replay_model(pred, config, RULES)
    if ranked is None:
        raise SystemExit(f"not replayed: {why}")
    held = sum(outside(config, pred.strategy, pred.tp, RULES).values())
    cap = int(config["budget"]["gpu_gib"] * GIB) - held
    g = config["generate"]
    prompt, new = int(g["prompt_tokens"]), int(g["new_tokens"])
    rows = []
    for p in points:
        calls = fragmentation.point_calls(new, int(g.get("warmup") or 0), int(g.get("repeats") or 1), p["logits"],
                                          p["logits_batch"])  # fmt: skip
        probe = fragmentation.probe(ranked, weights, p["batch"], prompt, calls, cap, pred.strategy.expandable_segments)
        rows.append({**p, "replay_fits": probe.fits, "replay_reserved_peak": probe.peak_reserved,
                     "replay_allocated_peak": probe.peak_allocated})  # fmt: skip
    return rows


def logits_cell(point: Dict[str, Any]) -> str:
    if not point["logits"]:
        return "no"
    return "yes" if point["logits_batch"] is None else f"yes, batch {point['logits_batch']}"


def gib(n) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def markdown(folder: Path, version: str, jobs: List[Dict[str, Any]]) -> str:
    lines = [
        f"# Each measured point of `{folder.name}` replayed with the calls it made (transformers {version})",
        "",
        f"`python benchmarks/replay_points.py {folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder}`;"
        " the reserved peak of rank 0 (the busiest rank as the replay holds the model) in GiB; `logits`: the point"
        " also made the correctness check's logits call (a load's first point that ran). Where a rank ran out of"
        " memory, rank 0's figure is what it reserved until the point ended.",
        "",
        "| job | configuration | batch | logits | measured | ranks out of memory | rank 0 reserved | replay "
        "| replay reserved |",
        "|---|---|---:|---|---|---|---:|---|---:|",
    ]
    for job in jobs:
        for r in job["points"]:
            ranks = ", ".join(map(str, r["oom_ranks"] or [])) or "-"
            replay = "fits" if r["replay_fits"] else "oom"
            lines.append(
                f"| {job['job']} | {job['label']} | {r['batch']} | {logits_cell(r)} | {r['status']} "
                f"| {ranks} | {gib(r['reserved_peak'])} | {replay} | {gib(r['replay_reserved_peak'])} |"
            )
    agree = sum((r["status"] == "ok") == r["replay_fits"] for j in jobs for r in j["points"])
    total = sum(len(j["points"]) for j in jobs)
    lines += ["", f"The replay agrees with the measured status at {agree} of {total} points."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path, help="a budget search's folder (its jobs' result.json files)")
    ap.add_argument("--out", type=Path, default=ROOT / "results/cpu", help="where the .json and .md go")
    args = ap.parse_args(argv)
    import transformers

    from dsexp.analysis.labels import config_label

    folder = args.folder.resolve()
    jobs = []
    for path in sorted(folder.glob("*/result.json"), key=lambda p: int(p.parent.name)):
        result = json.loads(path.read_text())
        points = measured_points(result)
        if not points:
            continue
        config = result["config"]
        label = config_label(config, workload=False)
        jobs.append({"job": path.parent.name, "label": label, "points": replay_job(config, points)})
        print(f"job {path.parent.name}: {len(points)} points replayed", flush=True)
    version = transformers.__version__
    stem = f"replay_points_{folder.name}_tf{version}"  # the version's dots: no Path.with_suffix
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{stem}.json").write_text(json.dumps({"transformers": version, "jobs": jobs}, indent=1) + "\n")
    (args.out / f"{stem}.md").write_text(markdown(folder, version, jobs))
    print((args.out / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
