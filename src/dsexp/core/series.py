"""A rank's memory over time: the side file `ranks/rank{N}.series.jsonl` the rank writes and the job reads.

JSON Lines. The first line is the header, every other line one reading the rank kept:

    {"format": "dsexp.series", "version": 1, "rank": 0, "fields": ["host_rss", "host_anon", "node_used"],
     "time": "s after clock.t0", "unit": "bytes", "clock_t0": 1767.0, "level": 0, "peaks_kept": true}
    [0.912345, 512000000, 401000000, 9100000000]

A row is `[t, value of each field]`, t in seconds after the rank's `clock.t0` (as its timeline), values in bytes,
null where that reading did not read the field (NVML's per-process figure and the allocator's are read one reading
in five). The rank appends rows at every heartbeat and phase end, so rows may come out of time order (a window's
peak reading is added when the window closes) and a hard death can tear the last line: readers sort and skip
what does not parse. `level` counts the coarsenings that kept the file under its cap; `peaks_kept` is false when
even the windows' peak readings had to be thinned (then a phase's peak may be missing from the series).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

FORMAT, VERSION = "dsexp.series", 1
HOST_FIELDS = ("host_rss", "host_anon", "node_used")
GPU_FIELDS = ("nvml_device_used", "nvml_process_used", "gpu_reserved", "gpu_alloc")


def series_file(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / "ranks" / f"rank{rank}.series.jsonl"


def header_line(rank: int, fields: Sequence[str], clock_t0: float, level: int, peaks_kept: bool) -> str:
    head = {
        "format": FORMAT,
        "version": VERSION,
        "rank": rank,
        "fields": list(fields),
        "time": "s after clock.t0",
        "unit": "bytes",
        "clock_t0": clock_t0,
        "level": level,
        "peaks_kept": peaks_kept,
    }
    return json.dumps(head, separators=(",", ":")) + "\n"


def row_line(t: float, values: Sequence[Optional[int]]) -> str:
    return json.dumps([round(t, 6), *values], separators=(",", ":")) + "\n"


def read_series(path: Path) -> Optional[Dict[str, Any]]:
    """The header's fields plus `points` (rows sorted by time) and `bytes` (the file's size); None without a
    readable header."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError:
        return None
    head = _parse(lines[0]) if lines else None
    if not isinstance(head, dict) or head.get("format") != FORMAT:
        return None
    width = len(head["fields"]) + 1
    rows = [r for r in map(_parse, lines[1:]) if isinstance(r, list) and len(r) == width]
    rows.sort(key=lambda r: r[0])
    return {**head, "points": rows, "bytes": os.path.getsize(path)}


def read_job_series(job_dir: Path, world_size: int) -> List[Optional[Dict[str, Any]]]:
    """Every rank's series (None for a rank that left none), with the file named relative to the job folder."""
    out = []
    for r in range(world_size):
        s = read_series(series_file(job_dir, r))
        out.append({**s, "file": str(series_file(".", r))} if s else None)
    return out


def column(series: Dict[str, Any], field: str) -> List[tuple]:
    """(t, value) of one field where it was read."""
    if field not in series.get("fields", ()):
        return []
    i = series["fields"].index(field) + 1
    return [(row[0], row[i]) for row in series.get("points", ()) if row[i] is not None]


def _parse(line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError:
        return None
