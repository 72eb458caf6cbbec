"""A rank's start-up (section `imports` of `make bench`): a fresh interpreter importing what a rank imports, step by
step.

    python benchmarks/rank_startup.py [--machine NAME] [--out DIR]

One process per repeat imports dsexp's rank worker, torch, DeepSpeed and transformers in turn and prints the clock
after each, so every step's cumulative time since the interpreter started comes from one process; the median of 3.
Kept as the `imports` section of results/<machine>/bench.json and bench.md (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

from common import gpu_count, main_of, table

SECTION = "imports"
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


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--repeats", type=int, default=3, help="imports: fresh interpreters (the median is kept)")


def run(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    repeats = args.repeats
    env = {**os.environ, "DS_ACCELERATOR": "cuda" if gpu_count() else "cpu"}
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


def render(data: Dict[str, Any]) -> List[str]:
    im = data[SECTION]
    out = ["## Imports (a rank's start-up)", "", im["note"] + ".", ""]
    return out + table(
        ["step", "s", "added"],
        [
            [s["step"], f"{s['wall_s']:.2f}", f"{s['wall_s'] - (im['steps'][i - 1]['wall_s'] if i else 0):+.2f}"]
            for i, s in enumerate(im["steps"])
        ],
    )


if __name__ == "__main__":
    sys.exit(main_of(__doc__, SECTION, add_arguments, run))
