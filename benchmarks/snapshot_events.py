"""A job's PyTorch memory snapshots (probe.memory_snapshot=true) as one small JSON file to compare with the replay.

    python3 benchmarks/snapshot_events.py JOB_DIR OUT.json.gz [--frames 3]

Per phase snapshot (ranks/snapshots/rank{N}_{phase}.pickle): the allocator's segments at the phase's end (address,
size, and each block's size and state, in address order) and the phase's allocator events (action, address, size,
and the innermost Python frames outside torch's own modules: which op asked). What the caching allocator did on the
GPU, event by event, beside what dsexp.predict.allocator replays from the meta trace. Needs only the standard library.
"""

from __future__ import annotations

import argparse
import gzip
import json
import pickle
from pathlib import Path


def frames_of(event: dict, keep: int) -> list:
    """The innermost `keep` Python frames that are not torch's own dispatch plumbing."""
    out = []
    for f in event.get("frames") or []:
        name = str(f.get("filename") or "")
        if "/torch/" in name and "/torch/nn/" not in name:
            continue
        out.append(f"{Path(name).name}:{f.get('line')}:{f.get('name')}")
        if len(out) >= keep:
            break
    return out


def segments_of(snap: dict) -> list:
    return [
        {
            "address": s["address"],
            "size": s["total_size"],
            "pool": "small" if s.get("segment_type") == "small" else "large",
            "blocks": [[b["size"], b["state"]] for b in s.get("blocks") or []],
        }
        for s in sorted(snap.get("segments") or [], key=lambda s: s["address"])
    ]


def events_of(snap: dict, keep: int) -> list:
    return [
        [e.get("action"), e.get("addr"), e.get("size"), frames_of(e, keep)]
        for trace in snap.get("device_traces") or []
        for e in trace
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("job_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--frames", type=int, default=3)
    args = ap.parse_args(argv)
    phases = {}
    for path in sorted((args.job_dir / "ranks" / "snapshots").glob("*.pickle")):
        with open(path, "rb") as f:
            snap = pickle.load(f)
        phases[path.stem] = {"segments": segments_of(snap), "events": events_of(snap, args.frames)}
        print(path.stem, len(phases[path.stem]["segments"]), "segments", len(phases[path.stem]["events"]), "events")
    with gzip.open(args.out, "wt") as f:
        json.dump(phases, f)
    print(f"wrote {args.out} ({args.out.stat().st_size} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
