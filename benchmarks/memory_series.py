"""The memory series' own cost (section `series` of `make bench`), in this process, apart from the machine's load.

    python benchmarks/memory_series.py [--series-rounds N] [--series-seconds S] [--machine NAME] [--out DIR]

The real sampler thread (reading /proc at the default period, heartbeat every 0.5 s) with the series and without it,
alternated (--series-rounds pairs of --series-seconds each), CPU of its thread per reading and as a share of a core;
and the series alone fed 10 simulated minutes of readings, flat and moving at every reading (its worst case): its
cost, points kept, coarsenings and size. Kept as the `series` section of results/<machine>/bench.json and bench.md
(benchmarks/common.py); sampler_on_off.py measures the sampler, series included, on real jobs.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from common import SAMPLER_CORE_PCT, compose, main_of, summary, table

SECTION = "series"


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--series-rounds", type=int, default=4, help="series: sampler with/without series pairs")
    ap.add_argument("--series-seconds", type=float, default=10.0, help="series: seconds of each run of a pair")


def run(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    return measure(args.series_rounds, args.series_seconds)


def measure(rounds: int, seconds: float) -> Dict[str, Any]:
    period = compose("tiny")["probe"]["sample_ms"] / 1000
    ab: Dict[str, List[Dict[str, float]]] = {"off": [], "on": []}
    for i in range(rounds):  # alternate which goes first, so a drift in the machine's load cancels
        for mode in ("off", "on") if i % 2 == 0 else ("on", "off"):
            ab[mode].append(sampler_thread_cost(period, mode == "on", seconds))
    per = {mode: summary([x["us_per_reading"] for x in runs]) for mode, runs in ab.items()}
    share = {mode: summary([x["core_pct"] for x in runs]) for mode, runs in ab.items()}
    added = [on["us_per_reading"] - off["us_per_reading"] for on, off in zip(ab["on"], ab["off"])]
    return {
        "period_ms": period * 1000,
        "rounds": rounds,
        "seconds": seconds,
        "runs": ab,
        "us_per_reading": per,
        "core_pct": share,
        "added_us_per_reading": summary(added),
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


def render(data: Dict[str, Any]) -> List[str]:
    """With the readings a second of the sampler section's jobs, where bench.json has them."""
    return render_series(data[SECTION], ((data.get("sampler") or {}).get("samples_per_s") or {}).get("mean"))


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
    out += table(
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
        f"{at_jobs}. The target (<= {SAMPLER_CORE_PCT:g}% of a core) is judged on the jobs, in the "
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
    return out + table(
        ["memory", "readings", "us a reading", "% of a core", "points kept", "coarsenings", "KB", "KB a minute"], rows
    )


if __name__ == "__main__":
    sys.exit(main_of(__doc__, SECTION, add_arguments, run))
