"""`make bench`: how fast dsexp itself is on this machine, and how much it disturbs what it measures.

    python benchmarks/run.py [--machine NAME] [--only imports,writer,overhead,sampler,series] [--big] [--pairs N]
                             [--sampler-model tiny|small] [--overhead-jobs N] [--out DIR] [--keep DIR]

Writes results/<machine>/bench.json and bench.md (machine: `cpu`, or `h200` / `h200x2` from NVML's
GPU name and count), both rewritten after every section. A run with --only updates those sections and
keeps the others. Not a test: timings on a shared machine are noisy, so nothing is asserted; each
figure is set against its target and a gap is stated as such. Sections run in this order; the jobs
use the benchmark's own cache (empty at the start) and MLflow store in a temporary folder.

- imports: a rank's start-up: a fresh interpreter importing what a rank imports, step by step.
- writer: the random-weight checkpoint writer (`python -m dsexp.models.writer`, as jobs run it) into an
  empty cache: GB/s of weights drawn and written (GB = 1e9 bytes), also counting the flush to disk
  (`sync`) after it; building the model skeleton on meta (imports included) is reported apart.
  Presets tiny and small, and internlm2_20b_shapes (~40 GB) on a GPU machine or with --big.
- overhead: identical `load=sharded` jobs (tiny; tp=2, or 1 on a machine of one GPU) under Hydra's
  basic launcher on the benchmark's empty cache. The first computes the random-weight checkpoint, the
  tp=1 reference logits and the per-rank split, the others must find all three (cache hits, reported
  with the seconds each miss took); each job's wall time is split by dsexp.analysis.overhead (the
  ranks' own work, and every step around it). The first job also pays the sweep process's one-time
  imports and is reported apart.
- sampler: paired jobs (`--sampler-model`, small; after a warm-up job unless it is tiny, which the
  overhead sweep left cached), each pair run back to back with the peak sampler at its default period
  and with it off (`probe.sample_ms=0`), half of the pairs on first and half off first; per phase, the
  geometric mean of the on/off wall-time ratios with a 95% interval, and the CPU share of the sampler
  thread (its `cpu_s` over the rank's lifetime), which includes keeping and appending the memory series; the
  series' size per rank per minute is read from the same jobs' series files.
- series: the memory series' own cost, in this process, apart from the machine's load: the real sampler thread
  (reading /proc at the default period, heartbeat every 0.5 s) with the series and without it, alternated
  (--series-rounds pairs of --series-seconds each), CPU of its thread per reading and as a share of a core; and
  the series alone fed 10 simulated minutes of readings, flat and moving at every reading (its worst case): its
  cost, points kept, coarsenings and size.
- stacks: preparing the seed's software stack (transformers 4.42.4, DeepSpeed 0.14.4, ...) into an empty cache,
  from the package index (or `--wheelhouse DIR`): the first build's time split into building DeepSpeed's wheel,
  resolving and installing; then the same stack again, which must be a cache hit in well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
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

from dsexp.analysis.overhead import DESCRIPTIONS, NOT_DSEXP, SEGMENTS, breakdown  # noqa: E402
from dsexp.analysis.sources import results_from_dir  # noqa: E402

SECTIONS = ("imports", "writer", "overhead", "sampler", "series", "stacks")  # run in this order
SCHEMA = 3  # bench.json of another schema is not merged into
TARGETS = {"overhead_s": 3.0, "sampler_core_pct": 1.0, "writer_gbps_gpu": 1.0, "stack_hit_s": 0.5}
RESOLVED, RESOLVED_S = 0.05, 0.05  # "no measurable shift" needs pairs that would show a shift of 5% or 50 ms
IMPORTS = (
    ("dsexp.rank.worker", "dsexp.rank.worker"),
    ("torch", "+ torch"),
    ("deepspeed", "+ deepspeed"),
    ("transformers", "+ transformers (imported in the load phase)"),
)
# A fresh interpreter imports IMPORTS in turn and prints perf_counter after each (CLOCK_MONOTONIC: the same
# clock as the parent's), so one process per repeat gives every step's cumulative time.
IMPORT_PROBE = (
    "import json, sys, time\nt = [time.perf_counter()]\nfor m in sys.argv[1:]:\n"
    "    __import__(m)\n    t.append(time.perf_counter())\nprint(json.dumps(t))"
)


def machine_name() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if n else ""
    except Exception:
        return "cpu"
    name = name.decode() if isinstance(name, bytes) else name
    model = re.search(r"\b([A-Z]\d{2,3}[A-Z]*)\b", name or "")
    if not n:
        return "cpu"
    return (model.group(1) if model else "gpu").lower() + (f"x{n}" if n > 1 else "")


def gpu_count() -> int:
    from dsexp.job.devices import visible_gpus

    return visible_gpus()


def dsexp(args: List[str], workdir: Path, log: Path) -> None:
    """`python -m dsexp ARGS` in workdir with the benchmark's own cache (workdir/cache, empty at first); output
    to log; raise with its tail on failure."""
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "dsexp", *args, f"cache_dir={workdir / 'cache'}"],
            cwd=workdir,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode:
        raise RuntimeError(f"dsexp {' '.join(args)} failed ({proc.returncode}):\n{log.read_text()[-3000:]}")


def results(sweep: Path) -> List[Dict[str, Any]]:
    """The sweep's results in job order; a benchmark only counts when every job worked."""
    out = results_from_dir(sweep)
    bad = [r["job_dir"] for r in out if r["status"] != "ok"]
    if bad:
        raise RuntimeError(f"jobs failed: {bad}")
    return out


def compose(model: str) -> Dict[str, Any]:
    """The job config `python -m dsexp model=<model>` runs (dsexp's own composition: its schema registered)."""
    from omegaconf import OmegaConf

    from dsexp.compose.config import compose_app, without_hydra

    return OmegaConf.to_container(without_hydra(compose_app([f"model={model}"])), resolve=True)


# --- sections ---------------------------------------------------------------------------------------


def bench_imports(gpus: int, repeats: int = 3) -> Dict[str, Any]:
    env = {**os.environ, "DS_ACCELERATOR": "cuda" if gpus else "cpu"}
    labels = ["interpreter"] + [label for _, label in IMPORTS] + ["exit"]
    runs = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = subprocess.run(
            [sys.executable, "-c", IMPORT_PROBE, *(m for m, _ in IMPORTS)],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        end = time.perf_counter()
        runs.append([t - t0 for t in json.loads(out.strip().splitlines()[-1])] + [end - t0])
    steps = [
        {"step": label, "wall_s": statistics.median(r[i] for r in runs), "runs": [r[i] for r in runs]}
        for i, label in enumerate(labels)
    ]
    for st in steps:
        print(f"imports: {st['step']}: {st['wall_s']:.2f} s")
    return {
        "steps": steps,
        "note": f"one fresh interpreter importing them in turn, seconds since it was started "
        f"(median of {repeats}); exit: until the process is gone",
    }


def bench_writer(models: List[str]) -> Dict[str, Any]:
    rows = []
    for name in models:
        m = compose(name)["model"]
        with tempfile.TemporaryDirectory(prefix="dsexp-writer-") as cache:
            args = dict(
                cache_dir=cache,
                name=m["name"],
                arch=m["arch"],
                dims=m["dims"],
                dtype=m["dtype"],
                fmt="safetensors",
                seed=m["seed"],
                shard_mb=m["shard_mb"],
            )
            t = time.perf_counter()
            out = subprocess.run(
                [sys.executable, "-m", "dsexp.models.writer", json.dumps(args)],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
            process_s = time.perf_counter() - t
            t = time.perf_counter()
            os.sync()
            sync_s = time.perf_counter() - t
        st = json.loads(out.strip().splitlines()[-1])
        rows.append(
            {
                "model": name,
                "bytes": st["bytes"],
                "write_s": st["seconds"],
                "weights_s": st["weights_s"],
                "sync_s": sync_s,
                "process_s": process_s,
                "gbps": st["bytes"] / 1e9 / st["weights_s"],
                "gbps_with_sync": st["bytes"] / 1e9 / (st["weights_s"] + sync_s),
            }
        )
        print(
            f"writer: {name}: {st['bytes'] / 1e9:.3f} GB of weights in {st['weights_s']:.2f} s = "
            f"{rows[-1]['gbps']:.2f} GB/s (+ sync {sync_s:.2f} s)"
        )
    return {"rows": rows}


def _summary(values: List[float]) -> Dict[str, float]:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)} if values else {}


CACHED = ("checkpoint", "reference", "split")


def bench_overhead(workdir: Path, tp: int, jobs: int, model: str = "tiny") -> Dict[str, Any]:
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
        "steady": {k: _summary([r[k] for r in steady if k in r]) for k in rows[-1] if k != "job"},
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


def bench_sampler(workdir: Path, pairs: int, model: str, warm: bool) -> Dict[str, Any]:
    """warm: the model's checkpoint and reference are cached already (the overhead sweep used it)."""
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
        p: {**_summary(v), **paired_ratio(v), "pairs": v, "off_s": statistics.mean(off_s[p])} for p, v in ratios.items()
    }
    return {
        "setup": f"model={model} tp=1, {pairs} pairs, probe.sample_ms={period:g} vs 0, back to back "
        f"({first} with the sampler on first, {pairs - first} with it off first)",
        "period_ms": period,
        "core_pct": _summary(shares),
        "us_per_sample": _summary(per_sample),
        "samples_per_s": _summary(rate),
        "expected_samples_per_s": 1000 / period,
        "ratio_on_off": shift,
        "series": {
            "jobs": series,
            "bytes_per_min": _summary([60 * x["bytes"] / x["life_s"] for x in series]),
            "points_per_min": _summary([60 * x["points"] / x["life_s"] for x in series]),
        },
    }


def bench_series(rounds: int, seconds: float) -> Dict[str, Any]:
    period = compose("tiny")["probe"]["sample_ms"] / 1000
    ab: Dict[str, List[Dict[str, float]]] = {"off": [], "on": []}
    for i in range(rounds):  # alternate which goes first, so a drift in the machine's load cancels
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            ab[mode].append(sampler_thread_cost(period, mode == "on", seconds))
    per = {mode: _summary([x["us_per_reading"] for x in runs]) for mode, runs in ab.items()}
    share = {mode: _summary([x["core_pct"] for x in runs]) for mode, runs in ab.items()}
    added = [on["us_per_reading"] - off["us_per_reading"] for on, off in zip(ab["on"], ab["off"])]
    return {
        "period_ms": period * 1000,
        "rounds": rounds,
        "seconds": seconds,
        "runs": ab,
        "us_per_reading": per,
        "core_pct": share,
        "added_us_per_reading": _summary(added),
        "simulated": {kind: series_alone(period, kind) for kind in ("flat", "moving")},
    }


def sampler_thread_cost(period_s: float, with_series: bool, seconds: float) -> Dict[str, float]:
    """The rank's sampler thread for `seconds` (main thread asleep), with or without the memory series (flushed
    at every heartbeat, as PhaseRecorder does): CPU of the thread per reading and as a share of a core."""
    from dsexp.core.series import HOST_FIELDS
    from dsexp.rank.probes.memory_series import MemorySeries
    from dsexp.rank.probes.sampler import PeakSampler

    with tempfile.TemporaryDirectory() as tmp:
        series = MemorySeries(Path(tmp) / "s.jsonl", 0, time.time(), time.perf_counter(), HOST_FIELDS, period_s)
        beat = (lambda peaks, last: series.flush()) if with_series else (lambda peaks, last: None)
        sampler = PeakSampler(period_s, beat=beat, series=series if with_series else None).start()
        t = time.perf_counter()
        for _ in range(int(seconds / 2)):  # windows close now and then, as phases end
            time.sleep(2.0)
            sampler.take()
        time.sleep(max(0.0, seconds - (time.perf_counter() - t)))
        sampler.stop()
        wall = time.perf_counter() - t
    return {"us_per_reading": 1e6 * sampler.cpu_s / sampler.samples, "core_pct": 100 * sampler.cpu_s / wall}


def series_alone(period_s: float, kind: str, minutes: float = 10.0) -> Dict[str, Any]:
    """The memory series fed `minutes` of readings at `period_s` (host fields; flat, or moving by 4 MiB at every
    reading), a window closed every 30 s, flushed every 0.5 s: its CPU per reading and per minute, and its size."""
    import random

    from dsexp.core.series import HOST_FIELDS, read_series
    from dsexp.rank.probes.memory_series import MemorySeries

    rng = random.Random(0)
    n, window, beat = int(minutes * 60 / period_s), int(30 / period_s), int(0.5 / period_s)
    vals = {"host_rss": 800 * 2**20, "host_anon": 600 * 2**20, "node_used": 20 * 2**30}
    with tempfile.TemporaryDirectory() as tmp:
        s = MemorySeries(Path(tmp) / "s.jsonl", 0, time.time(), 0.0, HOST_FIELDS, period_s)
        c0 = time.thread_time()
        for i in range(1, n + 1):
            if kind == "moving":
                vals = {k: v + rng.choice((-4, 4)) * 2**20 for k, v in vals.items()}
            s.add(i * period_s, vals)
            if i % window == 0:
                s.close_window()
            if i % beat == 0:
                s.flush()
        cpu = time.thread_time() - c0
        s.flush()
        size = read_series(s.path)["bytes"]
    return {
        "minutes": minutes,
        "readings": n,
        "us_per_reading": 1e6 * cpu / n,
        "core_pct": 100 * cpu / (minutes * 60),
        "points": len(s.points),
        "level": s.level,
        "bytes": size,
    }


# --- report --------------------------------------------------------------------------------------


def bench_stacks(workdir: Path, wheelhouse: str = None) -> Dict[str, Any]:
    from dsexp.core.schema import STACK_PRESETS, StackConfig
    from dsexp.job.overlay import prepare_stack

    stack = StackConfig(name="seed", **STACK_PRESETS["seed"], wheelhouse=wheelhouse)
    cache = str(workdir / "stack-cache")
    t0 = time.perf_counter()
    first = prepare_stack(stack, cache)
    first_s = time.perf_counter() - t0
    hits = []
    for _ in range(5):
        t = time.perf_counter()
        again = prepare_stack(stack, cache)
        hits.append(time.perf_counter() - t)
        assert again["cache_hit"], again
    return {
        "source": f"wheelhouse {wheelhouse}" if wheelhouse else "package index",
        "first_s": first_s,
        "build_s": first["build_s"],
        "plan_s": first["plan_s"],
        "install_s": first["install_s"],
        "bytes": first["bytes"],
        "packages": first["packages"],
        "hit_s": _summary(hits),
    }


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _table(head: List[str], rows: List[List[Any]]) -> List[str]:
    return [_row(head), _row(["---"] * len(head)), *map(_row, rows), ""]


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
    life = _summary([j["life_s"] for j in se["jobs"]])
    return [
        f"- Memory series on these jobs (ranks living {life['min']:.0f}-{life['max']:.0f} s, mostly imports and "
        f"loading, where memory moves at every reading): **{b['mean'] / 1e3:.1f} KB per rank per minute** (max "
        f"{b['max'] / 1e3:.1f}), {pts['mean']:.0f} points a minute; the sampler's CPU above includes keeping and "
        "appending it (its own cost, apart from the machine's load: Memory series below).",
        "",
    ]


def render_series(se: Dict[str, Any], jobs_rate: Optional[float]) -> List[str]:
    """jobs_rate: readings a second in the sampler section's jobs (a busy main thread delays them)."""
    on, off, added = se["core_pct"]["on"], se["core_pct"]["off"], se["added_us_per_reading"]
    out = [
        "## Memory series",
        "",
        f"The rank's sampler thread in this process at {se['period_ms']:g} ms (heartbeat every 0.5 s, a window "
        f"closed every 2 s, main thread asleep), with and without the memory series, {se['rounds']} alternated "
        f"pairs of {se['seconds']:g} s:",
        "",
    ]
    out += _table(
        ["sampler", "us a reading (mean)", "min", "max", "% of a core (mean)", "max"],
        [
            [
                mode,
                f"{se['us_per_reading'][mode]['mean']:.1f}",
                f"{se['us_per_reading'][mode]['min']:.1f}",
                f"{se['us_per_reading'][mode]['max']:.1f}",
                f"{se['core_pct'][mode]['mean']:.2f}",
                f"{se['core_pct'][mode]['max']:.2f}",
            ]
            for mode in ("off", "on")
        ],
    )
    at_jobs = (
        f", {added['mean'] * jobs_rate / 1e4:+.3f} points at the {jobs_rate:.0f} readings/s of the sampler's jobs above"
        if jobs_rate
        else ""
    )
    out += [
        f"- The series adds **{added['mean']:.1f} us a reading** (pairs: {added['min']:.1f} to {added['max']:.1f}), "
        f"{on['mean'] - off['mean']:+.3f} points of a core at this process's {1000 / se['period_ms']:.0f} readings/s"
        f"{at_jobs}. The target (<= {TARGETS['sampler_core_pct']:g}% of a core) is judged on the jobs, in the "
        "sampler section, whose figure includes the series.",
        "",
        "The series alone over 10 simulated minutes of readings (host fields, a window closed every 30 s, flushed "
        "every 0.5 s): flat memory (a point a second), and memory moving by 4 MiB at every reading (the worst case: "
        "the 2000-point cap holds by coarsening).",
        "",
    ]
    rows = [
        [
            kind,
            f"{x['readings']}",
            f"{x['us_per_reading']:.1f}",
            f"{x['core_pct']:.3f}",
            f"{x['points']}",
            f"{x['level']}",
            f"{x['bytes'] / 1e3:.1f}",
            f"{x['bytes'] / 1e3 / x['minutes']:.1f}",
        ]
        for kind, x in se["simulated"].items()
    ]
    return out + _table(
        ["memory", "readings", "us a reading", "% of a core", "points kept", "coarsenings", "KB", "KB a minute"], rows
    )


def met(value: float, limit: float, unit: str) -> str:
    """A figure with an upper limit: "met", or "NOT met" and by how much."""
    return "met" if value <= limit else f"NOT met (gap {value - limit:.2f} {unit})"


def render(data: Dict[str, Any]) -> str:
    gpu = bool(data.get("gpus"))
    out = [
        f"# dsexp's own speed on `{data['machine']}`",
        "",
        f"{data['time']} · {data['host']['cpus']} CPUs · {data['host']['mem_gib']:.0f} GiB · "
        f"Python {data['host']['python']} · generated by `make bench` (benchmarks/run.py); numbers from one "
        "run on a possibly shared machine, so expect noise of several percent.",
        "",
    ]
    ov = data.get("overhead")
    if ov:
        st = ov["steady"]
        own, total = st["overhead_dsexp"]["mean"], st["overhead"]["mean"]
        out += [
            "## Per-job overhead",
            "",
            f"Setup: {ov['setup']}. Mean of jobs 2-{len(ov['jobs'])} (seconds); job 1 "
            "is in the JSON. Segments follow one another, so they add up to the job's wall time.",
            "",
        ]
        names = ["hydra"] + [n for n, *_ in SEGMENTS]
        desc = {"hydra": "Hydra between jobs: composing the next job's config, its folder and logging", **DESCRIPTIONS}
        out += _table(
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
        verdict = met(own, TARGETS["overhead_s"], "s")
        out += [
            f"- wall time per job {st['total']['mean']:.2f} s, of which the ranks' own work "
            f"{st['rank_work']['mean']:.2f} s: overhead **{total:.2f} s**.",
            f"- overhead dsexp adds (all but {', '.join(NOT_DSEXP)}, which any torchrun + DeepSpeed job pays): "
            f"**{own:.2f} s** -> target <= {TARGETS['overhead_s']:.0f} s a job: {verdict}.",
            f"- the whole overhead incl. rank start-up against the same target: "
            f"{met(total, TARGETS['overhead_s'], 's')}; "
            f"rank start-up (a fresh interpreter importing torch and DeepSpeed) alone is "
            f"{st['rank_startup']['mean']:.2f} s, see Imports.",
            f"- once per sweep: start {ov['sweep_start_s']:.1f} s (interpreter, Hydra, validating every job, "
            f"MLflow parent run), end {ov['sweep_end_s']:.1f} s (table, report and plots); the first job of a "
            f"sweep process, cache work aside, took {ov['first_job_extra_s']:+.1f} s against the others (one-time "
            "imports of torch and MLflow in the Hydra process).",
            "",
        ]
    sp = data.get("sampler")
    if sp:
        cpu = sp["core_pct"]
        out += [
            "## Peak sampler",
            "",
            f"Setup: {sp['setup']}.",
            "",
            f"- CPU of the sampler thread: **{cpu['mean']:.2f}% of one core** (min {cpu['min']:.2f}, max "
            f"{cpu['max']:.2f}) at {sp['period_ms']:g} ms; {sp['us_per_sample']['mean']:.0f} us a reading; "
            f"{sp['samples_per_s']['mean']:.0f} readings/s (period allows {sp['expected_samples_per_s']:.0f}). "
            f"Target <= {TARGETS['sampler_core_pct']:g}%: "
            f"{met(cpu['max'], TARGETS['sampler_core_pct'], 'points')} (largest of the jobs).",
            "",
        ]
        out += _table(
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
        out += series_lines(sp.get("series"))
    if data.get("series"):
        out += render_series(data["series"], ((data.get("sampler") or {}).get("samples_per_s") or {}).get("mean"))
    wr = data.get("writer")
    if wr:
        out += [
            "## Checkpoint writer",
            "",
            "`python -m dsexp.models.writer` into an empty cache, as a job runs it. "
            "weights s: drawing and writing the weight shards (GB/s = 1e9 bytes of weights / that); skeleton s: "
            "building the model on meta first (imports included); `+ sync`: also waiting for the page cache to "
            "reach the disk; process s: the writer process from start to exit.",
            "",
        ]
        out += _table(
            ["model", "GB", "weights s", "GB/s", "sync s", "GB/s + sync", "skeleton s", "process s"],
            [
                [
                    r["model"],
                    f"{r['bytes'] / 1e9:.3f}",
                    f"{r['weights_s']:.2f}",
                    f"{r['gbps']:.2f}",
                    f"{r['sync_s']:.2f}",
                    f"{r['gbps_with_sync']:.2f}",
                    f"{r['write_s'] - r['weights_s']:.2f}",
                    f"{r['process_s']:.1f}",
                ]
                for r in wr["rows"]
            ],
        )
        big = max(wr["rows"], key=lambda r: r["bytes"])
        gap = TARGETS["writer_gbps_gpu"] - big["gbps"]
        out += [
            f"Target >= {TARGETS['writer_gbps_gpu']:g} GB/s on the GPU machine: "
            + (
                f"{'met' if gap <= 0 else f'NOT met (gap {gap:.2f} GB/s)'} ({big['model']}: {big['gbps']:.2f} GB/s)."
                if gpu
                else f"applies to the GPU machine (here the weights are drawn on {data['host']['cpus']} "
                f"CPU cores; {big['model']}: {big['gbps']:.2f} GB/s)."
            ),
            "",
        ]
    ca = (ov or {}).get("cache")
    if ca:
        out += [
            "## Reuse across a sweep (caches)",
            "",
            f"The per-job overhead sweep ({ov['setup']}). hit: found and "
            "reused; miss: computed by this job (seconds it took).",
            "",
        ]

        def cell(r, k):
            return r[k] + (f" ({r[k + '_s']:.1f} s)" if r.get(k + "_s") is not None else "")

        out += _table(
            ["job", "random-weight checkpoint", "tp=1 reference logits", "per-rank split", "preparation s"],
            [
                [r["job"], cell(r, "checkpoint"), cell(r, "reference"), cell(r, "split"), f"{r['prepare_s']:.2f}"]
                for r in ca["jobs"]
            ],
        )
        out += [f"Computed once, then reused: {'yes' if ca['as_expected'] else 'NO (see the table)'}.", ""]
    sk = data.get("stacks")
    if sk:
        hit = sk["hit_s"]["max"]
        out += [
            "## Software stacks",
            "",
            f"The seed's stack ({', '.join(sk['packages'])}) prepared into an empty cache from the {sk['source']}: "
            f"first build **{sk['first_s']:.1f} s** (DeepSpeed wheel {sk['build_s']:.1f} s, resolving "
            f"{sk['plan_s']:.1f} s, installing {sk['install_s']:.1f} s; {sk['bytes'] / 2**20:.0f} MiB). "
            f"Again, cached: {sk['hit_s']['mean'] * 1000:.1f} ms (max {hit * 1000:.1f} ms of 5) -> target "
            f"< {TARGETS['stack_hit_s']:g} s: {met(hit, TARGETS['stack_hit_s'], 's')}.",
            "",
        ]
    im = data.get("imports")
    if im:
        out += ["## Imports (a rank's start-up)", "", im["note"] + ".", ""]
        out += _table(
            ["step", "s", "added"],
            [
                [s["step"], f"{s['wall_s']:.2f}", f"{s['wall_s'] - (im['steps'][i - 1]['wall_s'] if i else 0):+.2f}"]
                for i, s in enumerate(im["steps"])
            ],
        )
    return "\n".join(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--machine", help="results/<machine>/ (default: cpu, or e.g. h200x2 from NVML)")
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    ap.add_argument(
        "--big",
        action="store_true",
        help="writer: also internlm2_20b_shapes (~40 GB) without a GPU (a GPU machine always does)",
    )
    ap.add_argument("--pairs", type=int, default=6, help="sampler: on/off job pairs (even: each order as often)")
    ap.add_argument(
        "--sampler-model",
        default="small",
        help="sampler: the jobs' model preset (tiny: no warm-up job after the overhead section)",
    )
    ap.add_argument("--series-rounds", type=int, default=4, help="series: sampler with/without series pairs")
    ap.add_argument("--series-seconds", type=float, default=10.0, help="series: seconds of each run of a pair")
    ap.add_argument(
        "--overhead-jobs", type=int, default=4, help="overhead: jobs in the sweep (>= 2; the first is reported apart)"
    )
    ap.add_argument("--out", type=Path, default=ROOT / "results", help="results root")
    ap.add_argument("--keep", type=Path, help="copy the benchmark's sweep folders and logs here")
    ap.add_argument("--wheelhouse", help="stacks: install from this folder instead of the package index")
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    machine = args.machine or machine_name()
    folder = args.out / machine
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads((folder / "bench.json").read_text()) if (folder / "bench.json").is_file() else {}
    if data.get("schema") != SCHEMA:
        data = {"schema": SCHEMA}
    import psutil

    gpus = gpu_count()
    data.update(
        machine=machine,
        gpus=gpus,
        time=time.strftime("%Y-%m-%d %H:%M"),
        host={
            "cpus": len(os.sched_getaffinity(0)),
            "mem_gib": psutil.virtual_memory().total / 2**30,
            "python": platform.python_version(),
        },
    )
    big = args.big or gpus > 0
    tp = 1 if gpus == 1 else 2  # the overhead sweep's: 2 ranks (CPU processes or GPUs) where the machine has them
    warm = "overhead" in only and args.sampler_model == "tiny"
    sections = {
        "imports": lambda work: bench_imports(gpus),
        "writer": lambda work: bench_writer(["tiny", "small"] + (["internlm2_20b_shapes"] if big else [])),
        "overhead": lambda work: bench_overhead(work, tp, args.overhead_jobs),
        "sampler": lambda work: bench_sampler(work, args.pairs, args.sampler_model, warm),
        "series": lambda work: bench_series(args.series_rounds, args.series_seconds),
        "stacks": lambda work: bench_stacks(work, args.wheelhouse),
    }
    with tempfile.TemporaryDirectory(prefix="dsexp-bench-") as tmp:
        work = Path(tmp)
        try:
            for name in (n for n in SECTIONS if n in only):  # rewritten after each: a run cut short keeps them
                t = time.perf_counter()
                data[name] = {**sections[name](work), "section_s": time.perf_counter() - t}
                (folder / "bench.json").write_text(json.dumps(data, indent=1))
                (folder / "bench.md").write_text(render(data) + "\n")
        finally:
            if args.keep:
                shutil.copytree(
                    work, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.pt", "*.safetensors")
                )
    print(render(data))
    print(f"\nwrote {folder / 'bench.json'} and bench.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
