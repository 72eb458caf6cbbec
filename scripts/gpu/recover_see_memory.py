"""Fill in see_memory_usage figures that a run logged but did not capture, from its rank 0 log.

DeepSpeed 0.14 logs see_memory_usage through its logger (stderr, the rank's log) where 0.19 prints it; dsexp's
capture read stdout only until it learnt both (rank/probes/see_memory.py), so the first seed-stack GPU runs have the
figures in ranks/rank0.log alone. Each recovered phase is marked `"source": "rank0.log"`.
Usage: recover_see_memory.py SWEEPS_DIR (rewrites result.json files in place)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from dsexp.core.records import aggregate_metrics
from dsexp.rank.probes.see_memory import parse

BLOCK = re.compile(
    r"see_memory_usage\] dsexp: after (\w+)\n(.*?see_memory_usage\].*?\n.*?see_memory_usage\].*?\n)", re.S
)


def recover(result_path: Path) -> int:
    log = result_path.parent / "ranks" / "rank0.log"
    res = json.loads(result_path.read_text())
    if not log.is_file() or not res.get("ranks") or not res["ranks"][0]:
        return 0
    found = {phase: parse(text) for phase, text in BLOCK.findall(log.read_text())}
    n = 0
    for phase, rec in res["ranks"][0].get("phases", {}).items():
        if not (rec.get("see_memory_usage") or {}).get("printed") and found.get(phase, {}).get("printed"):
            rec["see_memory_usage"] = {**found[phase], "source": "rank0.log"}
            n += 1
    if n:
        res["metrics"] = aggregate_metrics(res["ranks"])  # the see_memory_* metrics come from the phase records
        result_path.write_text(json.dumps(res, indent=1))
    return n


if __name__ == "__main__":
    for path in sorted(Path(sys.argv[1]).rglob("result.json")):
        print(path, recover(path))
