"""The peak sampler's cost on real jobs (section `sampler` of `make bench`): its thread's CPU, and whether it shifts
phase times.

    python benchmarks/sampler_on_off.py [--pairs N] [--sampler-model tiny|small] [--machine NAME] [--out DIR]

Paired jobs (`--sampler-model`, small; after a warm-up job unless it is tiny and job_overhead.py ran before it in the
same work folder, as `make bench` runs them, leaving it cached), each pair run back to back with the peak sampler at
its default period and with it off (`probe.sample_ms=0`), half of the pairs on first and half off first; per phase,
the geometric mean of the on/off wall-time ratios with a 95% interval, and the CPU share of the sampler thread (its
`cpu_s` over the rank's lifetime), which includes keeping and appending the memory series; the series' size per rank
per minute is read from the same jobs' series files. Kept as the `sampler` section of results/<machine>/bench.json
and bench.md (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List

from common import SAMPLER_CORE_PCT, compose, dsexp, main_of, met, results, summary, table

SECTION = "sampler"
RESOLVED, RESOLVED_S = 0.05, 0.05  # "no measurable shift" needs pairs that would show a shift of 5% or 50 ms


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--pairs", type=int, default=6, help="sampler: on/off job pairs (even: each order as often)")
    ap.add_argument(
        "--sampler-model",
        default="small",
        help="sampler: the jobs' model preset (tiny: no warm-up job after the overhead section)",
    )


def run(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    warm = "overhead" in args.done and args.sampler_model == "tiny"  # job_overhead.py's jobs ran tiny in `work`
    return measure(work, args.pairs, args.sampler_model, warm)


# two-sided 95% quantiles of Student's t for 1..10 degrees of freedom
T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


def paired_ratio(ratios: List[float]) -> Dict[str, Any]:
    """Geometric mean of paired on/off ratios with its 95% confidence interval (t on the log ratios).

    A shift is measurable when the interval excludes 1; its width says how small a shift the pairs could
    have seen on this machine (run-to-run noise of a shared machine makes it wide)."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.mean(logs)
    if len(logs) < 2:
        return {"ratio": math.exp(mean), "ci95": None, "measurable": None}
    half = T975[min(len(logs) - 1, len(T975)) - 1] * statistics.stdev(logs) / math.sqrt(len(logs))
    lo, hi = math.exp(mean - half), math.exp(mean + half)
    return {"ratio": math.exp(mean), "ci95": [lo, hi], "measurable": not lo <= 1 <= hi}


def measure(workdir: Path, pairs: int, model: str, warm: bool) -> Dict[str, Any]:
    """warm: the model's checkpoint and reference are cached already in workdir (job_overhead.py's sweep used it)."""
    period = compose(model)["probe"]["sample_ms"]
    if not warm:
        dsexp(
            ["-m", f"model={model}", "tp=1", "variant=warmup", "hydra.sweep.dir=multirun/sampler_warmup"],
            workdir,
            workdir / "sampler_warmup.log",
        )
    # Half the pairs run with the sampler on first, half off first, so a drift in the machine's load cancels.
    first = (pairs + 1) // 2
    halves = {
        "on_first": (range(1, first + 1), f"{period:g},0"),
        "off_first": (range(first + 1, pairs + 1), f"0,{period:g}"),
    }
    pairs_run = []
    for name, (numbers, order) in halves.items():
        if not numbers:
            continue
        dsexp(
            [
                "-m",
                f"model={model}",
                "tp=1",
                "variant=" + ",".join(f"s{i}" for i in numbers),
                f"probe.sample_ms={order}",
                f"hydra.sweep.dir=multirun/sampler_{name}",
            ],
            workdir,
            workdir / f"sampler_{name}.log",
        )
        jobs = results(workdir / "multirun" / f"sampler_{name}")
        pairs_run += [
            sorted(pair, key=lambda r: -r["config"]["probe"]["sample_ms"])  # (on, off)
            for pair in zip(jobs[0::2], jobs[1::2])
        ]
    ratios: Dict[str, List[float]] = {p: [] for p in ("load", "init", "generate", "work")}
    off_s: Dict[str, List[float]] = {p: [] for p in ratios}
    shares, per_sample, rate, series = [], [], [], []
    for on, off in pairs_run:
        assert on["config"]["probe"]["sample_ms"] > 0 == off["config"]["probe"]["sample_ms"]
        assert on["config"]["variant"] == off["config"]["variant"]
        w_on, w_off = (
            {p: r["ranks"][0]["phases"][p]["wall_s"] for p in ("load", "init", "generate")} for r in (on, off)
        )
        for w in (w_on, w_off):
            w["work"] = sum(w.values())
        for p in ratios:
            ratios[p].append(w_on[p] / w_off[p])
            off_s[p].append(w_off[p])
        for rk in on["ranks"]:
            life = rk["clock"]["finished"] - rk["clock"]["t0"]
            s = rk["sampler"]
            shares.append(100 * s["cpu_s"] / life)
            per_sample.append(1e6 * s["cpu_s"] / s["samples"])
            rate.append(s["samples"] / life)
        for rk, ser in zip(on["ranks"], on.get("series") or []):
            life = rk["clock"]["finished"] - rk["clock"]["t0"]
            series.append({"life_s": life, "points": len(ser["points"]), "bytes": ser["bytes"]})
    shift = {
        p: {**summary(v), **paired_ratio(v), "pairs": v, "off_s": statistics.mean(off_s[p])} for p, v in ratios.items()
    }
    return {
        "setup": f"model={model} tp=1, {pairs} pairs, probe.sample_ms={period:g} vs 0, back to back "
        f"({first} with the sampler on first, {pairs - first} with it off first)",
        "period_ms": period,
        "core_pct": summary(shares),
        "us_per_sample": summary(per_sample),
        "samples_per_s": summary(rate),
        "expected_samples_per_s": 1000 / period,
        "ratio_on_off": shift,
        "series": {
            "jobs": series,
            "bytes_per_min": summary([60 * x["bytes"] / x["life_s"] for x in series]),
            "points_per_min": summary([60 * x["points"] / x["life_s"] for x in series]),
        },
    }


def render(data: Dict[str, Any]) -> List[str]:
    sp = data[SECTION]
    cpu = sp["core_pct"]
    out = [
        "## Peak sampler",
        "",
        f"Setup: {sp['setup']}.",
        "",
        f"- CPU of the sampler thread: **{cpu['mean']:.2f}% of one core** (min {cpu['min']:.2f}, max "
        f"{cpu['max']:.2f}) at {sp['period_ms']:g} ms; {sp['us_per_sample']['mean']:.0f} us a reading; "
        f"{sp['samples_per_s']['mean']:.0f} readings/s (period allows {sp['expected_samples_per_s']:.0f}). "
        f"Target <= {SAMPLER_CORE_PCT:g}%: "
        f"{met(cpu['max'], SAMPLER_CORE_PCT, 'points')} (largest of the jobs).",
        "",
    ]
    out += table(
        ["phase", "s (sampler off)", "on/off (geometric mean)", "95% CI", "pairs", "shift"],
        [
            [
                p,
                f"{r['off_s']:.3f}",
                f"{r['ratio']:.3f}",
                "-" if not r["ci95"] else f"{r['ci95'][0]:.3f} - {r['ci95'][1]:.3f}",
                ", ".join(f"{x:.3f}" for x in r["pairs"]),
                _shift_word(r),
            ]
            for p, r in sp["ratio_on_off"].items()
        ],
    )
    out += ["Target: no measurable shift of phase times: " + _shift_verdict(sp["ratio_on_off"]), ""]
    return out + series_lines(sp.get("series"))


def _resolution(r: Dict[str, Any]) -> float:
    """The smallest relative shift a paired ratio's 95% interval would have shown."""
    lo, hi = r["ci95"]
    return max(1 - lo, hi - 1)


def _shift_word(r: Dict[str, Any]) -> str:
    if r["measurable"] is None:
        return "one pair: not judged"
    if r["measurable"]:
        return f"measurable: {100 * (r['ratio'] - 1):+.1f}%"
    return f"none measurable (pairs resolve shifts beyond {100 * _resolution(r):.1f}%)"


def _shift_verdict(phases: Dict[str, Dict[str, Any]]) -> str:
    judged = {p: r for p, r in phases.items() if r["ci95"]}
    if not judged:
        return "not decided (one pair)."
    shifted = [p for p, r in judged.items() if r["measurable"]]
    if shifted:
        return f"NOT met ({', '.join(shifted)})."
    blurred = [
        f"{p} {100 * _resolution(r):.0f}%"
        for p, r in judged.items()
        if _resolution(r) > RESOLVED and _resolution(r) * r["off_s"] > RESOLVED_S
    ]
    if blurred:
        return (
            f"not decided: no shift measurable, but run-to-run noise here lets these pairs resolve only shifts "
            f"beyond {', '.join(blurred)} (more pairs or a quieter machine)."
        )
    return f"met (every 95% interval holds 1 and would show a shift of {100 * RESOLVED:g}% or {RESOLVED_S:g} s)."


def series_lines(se: Dict[str, Any]) -> List[str]:
    """The memory series' size on the sampler section's jobs."""
    if not se:
        return []
    b, pts = se["bytes_per_min"], se["points_per_min"]
    life = summary([j["life_s"] for j in se["jobs"]])
    return [
        f"- Memory series on these jobs (ranks living {life['min']:.0f}-{life['max']:.0f} s, mostly imports and "
        f"loading, where memory moves at every reading): **{b['mean'] / 1e3:.1f} KB per rank per minute** (max "
        f"{b['max'] / 1e3:.1f}), {pts['mean']:.0f} points a minute; the sampler's CPU above includes keeping and "
        "appending it (its own cost, apart from the machine's load: Memory series below).",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main_of(__doc__, SECTION, add_arguments, run))
