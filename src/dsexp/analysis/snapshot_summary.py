"""`python -m dsexp.analysis.snapshot_summary PICKLE... [--top N] [--out FILE] [--events FILE]`: PyTorch memory
snapshots, summarised.

A snapshot (`probe.memory_snapshot=true`: ranks/snapshots/rank{N}_{phase}.pickle) can be hundreds of MB; its
summary is a few KB of JSON, small enough to commit: per file, the allocator's segments (reserved, allocated,
active bytes), the live tensors' bytes by allocation site (the innermost frame outside torch's own code) and the
phase's allocator events: counts by action, bytes allocated by site, and the highest allocated total the history
reaches (the state at the end, minus what the history allocated and freed, plus its highest running total; frees
count when completed). Snapshots hold only plain containers, so they are read with an unpickler that refuses any
class: a pickle that names one is not a memory snapshot and is not trusted.

`--events FILE` also writes each file's allocator events in order, as `[action, bytes, address]` (gzipped JSON, MBs
where the pickles are hundreds): what dsexp.predict.allocator.Allocator replays, to hold the replay of a load and a
generate to what the GPU's own allocator did (as tests/test_fragmentation.py does for results/h200/fragmentation).
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
import re
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence

NAME = re.compile(r"rank(?P<rank>\d+)_(?P<phase>.+)\.pickle$")
TORCH_CODE = ("/torch/", "\\torch\\")  # frames of torch's own Python code: the site is the caller


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        raise pickle.UnpicklingError(f"not a memory snapshot: the pickle names {module}.{name}")


def load(path: Path) -> Dict[str, Any]:
    with open(path, "rb") as f:
        snap = _PlainUnpickler(f).load()
    if not isinstance(snap, dict) or "segments" not in snap:
        raise ValueError(f"{path}: not a PyTorch memory snapshot (no 'segments')")
    return snap


def site(frames: Sequence[Dict[str, Any]]) -> str:
    """`file:line function` of the innermost frame outside torch's own code (else the innermost one)."""
    if not frames:
        return "(no stack)"
    frame = next((f for f in frames if not any(t in str(f.get("filename", "")) for t in TORCH_CODE)), frames[0])
    return f"{frame.get('filename')}:{frame.get('line')} {frame.get('name')}"


def top(by_site: Counter, n: int) -> List[Dict[str, Any]]:
    return [{"site": s, "bytes": b} for s, b in by_site.most_common(n)]


def segments_summary(segments: Iterable[Dict[str, Any]], n: int) -> Dict[str, Any]:
    segments = list(segments)
    live: Counter = Counter()
    for seg in segments:
        for block in seg.get("blocks", ()):
            if block.get("state") == "active_allocated":
                live[site(block.get("frames") or ())] += block.get("size", 0)
    return {
        "segments": len(segments),
        "reserved_bytes": sum(s.get("total_size", 0) for s in segments),
        "allocated_bytes": sum(s.get("allocated_size", 0) for s in segments),
        "active_bytes": sum(s.get("active_size", 0) for s in segments),
        "live_by_site": top(live, n),
    }


def history_summary(events: Sequence[Dict[str, Any]], allocated_at_end: int, n: int) -> Dict[str, Any]:
    actions = Counter(e.get("action") for e in events)
    allocated: Counter = Counter()
    running = highest = 0
    for e in events:
        if e.get("action") == "alloc":
            allocated[site(e.get("frames") or ())] += e.get("size", 0)
            running += e.get("size", 0)
        elif e.get("action") == "free_completed":
            running -= e.get("size", 0)
        highest = max(highest, running)
    return {
        "events": len(events),
        "actions": dict(actions),
        "allocated_by_site": top(allocated, n),
        "allocated_peak_bytes": allocated_at_end - running + highest if events else None,
        "oom": actions.get("oom", 0),
    }


def summarise(snap: Dict[str, Any], n: int = 15) -> Dict[str, Any]:
    out = segments_summary(snap.get("segments", ()), n)
    events = [e for trace in snap.get("device_traces", ()) for e in trace]
    out["history"] = history_summary(events, out["allocated_bytes"], n)
    return out


def events(snap: Dict[str, Any]) -> List[List[Any]]:
    """The snapshot's allocator events in order, [action, bytes, address] (alloc, free_requested, free_completed,
    segment_alloc, segment_free, oom: its bytes are the request that found no room)."""
    return [
        [e.get("action"), e.get("size", 0), e.get("addr", 0)] for trace in snap.get("device_traces", ()) for e in trace
    ]


def label(path: Path) -> Dict[str, Any]:
    m = NAME.search(Path(path).name)
    return {"rank": int(m["rank"]), "phase": m["phase"]} if m else {}


def summarise_file(path: Path, n: int = 15) -> Dict[str, Any]:
    head: Dict[str, Any] = {"file": Path(path).name, "bytes": Path(path).stat().st_size, **label(path)}
    return {**head, **summarise(load(path), n)}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsexp.analysis.snapshot_summary", description=__doc__.splitlines()[0])
    ap.add_argument("pickles", nargs="+", type=Path, help="snapshot files (or folders holding *.pickle)")
    ap.add_argument("--top", type=int, default=15, help="allocation sites listed per file")
    ap.add_argument("--out", type=Path, help="write the JSON here (default: stdout)")
    ap.add_argument("--events", type=Path, help="also write every file's allocator events here (gzipped JSON)")
    ap.add_argument("--rank", type=int, help="only this rank's files (rank{N}_*.pickle) of the folders given")
    args = ap.parse_args(argv)
    files = [f for p in args.pickles for f in (sorted(p.glob("**/*.pickle")) if p.is_dir() else [p])]
    files = [f for f in files if args.rank is None or label(f).get("rank") == args.rank]
    summaries, traces, failed = [], [], 0
    for f in files:
        try:
            summaries.append(summarise_file(f, args.top))
            if args.events:  # read again: one snapshot of hundreds of MB in memory at a time
                traces.append({"file": str(f), **label(f), "events": events(load(f))})
        except (OSError, ValueError, pickle.UnpicklingError, EOFError) as e:
            print(f"dsexp snapshots: {f}: {e}", file=sys.stderr)
            failed += 1
    if args.events:
        with gzip.open(args.events, "wt") as out:
            json.dump({"snapshots": traces}, out)
    text = json.dumps({"snapshots": summaries}, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 1 if failed or not files else 0


if __name__ == "__main__":
    sys.exit(main())
