"""A job's ranks as one Chrome trace (`trace.json`), opened as it is by ui.perfetto.dev and chrome://tracing.

One process per rank (`pid`: the rank's OS process id; `process_name` "rank N", sorted by rank; where a rank out
of memory ended a launch and the job launched again for the points left, each launch's ranks are processes of their
own, "rank N (launch K of M)"), its phases as
complete events (`X`, name: the phase key as in the rank record, `cat` "phase", args: kind, wall_s and the
phase's sampled peaks in bytes; a phase the rank died in is drawn up to its last heartbeat, args.partial true),
and its memory series as counters (`C`, name: the series field, e.g. host_rss, one arg `bytes`; Perfetto names
the track "host_rss bytes"). Timestamps are integer microseconds after the earliest rank's clock.t0 (each rank's
own times are shifted by its clock.t0's difference from it), at the series' resolution, so a phase's counters are
exactly those with ts in (ts, ts + dur] of its slice.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

TRACE = "trace.json"
PHASES_TID_NAME = "phases"


def us(seconds: float) -> int:
    """Seconds -> integer microseconds, rounded as the series file rounds its times (6 decimals)."""
    return round(round(seconds, 6) * 1e6)


def rank_views(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Per rank present in the records or the series: {rank, record, series, clock_t0}, by rank."""
    records = {r["rank"]: r for r in result.get("ranks") or [] if r and "rank" in r}
    series = {s["rank"]: s for s in result.get("series") or [] if s}
    out = []
    for rank in sorted(set(records) | set(series)):
        rec, ser = records.get(rank) or {}, series.get(rank)
        t0 = (rec.get("clock") or {}).get("t0") or (ser or {}).get("clock_t0")
        if t0 is None and rec.get("timeline"):  # a record without a clock (older results): its own zero
            t0 = 0.0
        if t0 is not None:
            out.append({"rank": rank, "record": rec, "series": ser, "clock_t0": t0})
    return out


def phase_spans(rec: Dict[str, Any], clock_t0: float) -> List[Dict[str, Any]]:
    """The rank's phases in time order: {key, kind, t0, t1, partial} in seconds after its clock.t0; a partial phase
    (the one a dead rank was in) ends at its last heartbeat; one its error cut short ends at the error."""
    failed_in = (rec.get("error") or {}).get("phase")  # a phase cut short by the rank's error did not end either
    spans = [
        {"key": e["phase"], "kind": e.get("kind", e["phase"]), "t0": e["t0"], "t1": e["t1"],
         "partial": e["phase"] == failed_in}
        for e in rec.get("timeline") or []
    ]  # fmt: skip
    timed = {s["key"] for s in spans}
    for key, phase in (rec.get("phases") or {}).items():
        if phase.get("partial") and key not in timed and rec.get("last_alive") and phase.get("wall_s") is not None:
            t1 = rec["last_alive"] - clock_t0
            spans.append({"key": key, "kind": key, "t0": t1 - phase["wall_s"], "t1": t1, "partial": True})
    return sorted(spans, key=lambda s: s["t0"])


def launch_views(result: Dict[str, Any], earlier: Sequence[Dict[str, Any]] = ()) -> List[Dict[str, Any]]:
    """The rank views of every launch, oldest first, each tagged with its launch number (None where there was one
    launch). earlier: the launches an out-of-memory relaunch archived ({ranks, series} each, dsexp.job.oom_relaunch):
    their ranks are processes of their own in the trace, so the point that ran out stays visible."""
    if not earlier:
        return rank_views(result)
    out = []
    for n, launch in enumerate([*earlier, result], 1):
        out += [{**v, "launch": n, "launches": len(earlier) + 1} for v in rank_views(launch)]
    return out


def chrome_trace(result: Dict[str, Any], earlier: Sequence[Dict[str, Any]] = ()) -> Dict[str, Any]:
    views = launch_views(result, earlier)
    origin = min((v["clock_t0"] for v in views), default=0.0)
    events: List[Dict[str, Any]] = []
    for view, pid in zip(views, pids(views)):
        events += rank_events(view, pid, us(view["clock_t0"] - origin))
    config = result.get("config") or {}
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "format": "dsexp.trace/1",
            "job_dir": result.get("job_dir"),
            "status": result.get("status"),
            "cause": (result.get("failure") or {}).get("cause"),
            "clock_t0": origin,
            "time": "microseconds after clock_t0 (epoch seconds)",
        },
        "distributedInfo": {
            "backend": "nccl" if (result.get("runtime") or {}).get("device") == "cuda" else "gloo",
            "world_size": config.get("tp", len(views)),
        },
    }


def pids(views: List[Dict[str, Any]]) -> List[int]:
    """The ranks' OS pids, where they are known and distinct (several nodes may reuse one), else 1 + rank."""
    real = [v["record"].get("pid") for v in views]
    if all(isinstance(p, int) and p > 0 for p in real) and len(set(real)) == len(real):
        return real
    return [1 + v["rank"] + 1000 * (v.get("launch") or 0) for v in views]


def rank_events(view: Dict[str, Any], pid: int, offset: int) -> List[Dict[str, Any]]:
    rank, rec, launch = view["rank"], view["record"], view.get("launch")
    host = rec.get("hostname")
    name = f"rank {rank}" + (f" (launch {launch} of {view['launches']})" if launch else "")
    events: List[Dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "args": {"name": name}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": rank + 1000 * (launch or 0)}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": pid, "args": {"name": PHASES_TID_NAME}},
    ]
    if host:
        events.append({"ph": "M", "name": "process_labels", "pid": pid, "args": {"labels": str(host)}})
    for span in phase_spans(rec, view["clock_t0"]):
        events.append(phase_event(span, rec, pid, offset))
    if view["series"]:
        events += counter_events(view["series"], pid, offset)
    return events


def phase_event(span: Dict[str, Any], rec: Dict[str, Any], pid: int, offset: int) -> Dict[str, Any]:
    phase = (rec.get("phases") or {}).get(span["key"]) or {}
    ts = offset + us(span["t0"])
    args: Dict[str, Any] = {"kind": span["kind"], "wall_s": phase.get("wall_s"), **(phase.get("peaks") or {})}
    if span["partial"]:
        args["partial"] = True
    error = rec.get("error") or {}
    if error.get("phase") == span["key"]:
        args["error"] = f"{error.get('type')}: {error.get('message')}"[:500]
    if phase.get("memory_snapshot", {}).get("file"):
        args["memory_snapshot"] = phase["memory_snapshot"]["file"]
    end = offset + us(span["t1"])
    return {
        "ph": "X",
        "cat": "phase",
        "name": span["key"],
        "pid": pid,
        "tid": pid,
        "ts": ts,
        "dur": end - ts,
        "args": args,
    }


def counter_events(series: Dict[str, Any], pid: int, offset: int) -> List[Dict[str, Any]]:
    fields = series["fields"]
    out = []
    for row in series["points"]:
        ts = offset + us(row[0])
        for name, value in zip(fields, row[1:]):
            if value is not None:
                out.append({"ph": "C", "name": name, "pid": pid, "tid": pid, "ts": ts, "args": {"bytes": value}})
    return out


def write_trace(result: Dict[str, Any], path: Path, earlier: Sequence[Dict[str, Any]] = ()) -> Optional[Path]:
    """trace.json for the job (compact JSON), earlier launches included; None when no rank left a record or a
    series."""
    trace = chrome_trace(result, earlier)
    if not any(e["ph"] in "XC" for e in trace["traceEvents"]):
        return None
    Path(path).write_text(json.dumps(trace, separators=(",", ":")))
    return Path(path)
