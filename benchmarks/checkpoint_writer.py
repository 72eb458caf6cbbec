"""The random-weight checkpoint writer (section `writer` of `make bench`): GB/s of weights drawn and written.

    python benchmarks/checkpoint_writer.py [--big] [--machine NAME] [--out DIR]

Runs `python -m dsexp.models.writer`, as jobs run it, into an empty cache: GB/s of weights drawn and written (GB =
1e9 bytes), also counting the flush to disk (`sync`) after it; building the model skeleton on meta (imports included)
is reported apart. Presets tiny and small, and internlm2_20b_shapes (~40 GB) on a GPU machine or with --big. Kept as
the `writer` section of results/<machine>/bench.json and bench.md (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Dict, List

from common import compose, gpu_count, main_of, table

SECTION = "writer"
TARGET_GBPS_GPU = 1.0  # on the GPU machine


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--big",
        action="store_true",
        help="writer: also internlm2_20b_shapes (~40 GB) without a GPU (a GPU machine always does)",
    )


def run(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    big = args.big or gpu_count() > 0
    return measure(["tiny", "small"] + (["internlm2_20b_shapes"] if big else []))


def measure(models: List[str]) -> Dict[str, Any]:
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


def render(data: Dict[str, Any]) -> List[str]:
    wr = data[SECTION]
    out = [
        "## Checkpoint writer",
        "",
        "`python -m dsexp.models.writer` into an empty cache, as a job runs it. "
        "weights s: drawing and writing the weight shards (GB/s = 1e9 bytes of weights / that); skeleton s: "
        "building the model on meta first (imports included); `+ sync`: also waiting for the page cache to "
        "reach the disk; process s: the writer process from start to exit.",
        "",
    ]
    out += table(
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
    gap = TARGET_GBPS_GPU - big["gbps"]
    return out + [
        f"Target >= {TARGET_GBPS_GPU:g} GB/s on the GPU machine: "
        + (
            f"{'met' if gap <= 0 else f'NOT met (gap {gap:.2f} GB/s)'} ({big['model']}: {big['gbps']:.2f} GB/s)."
            if data.get("gpus")
            else f"applies to the GPU machine (here the weights are drawn on {data['host']['cpus']} "
            f"CPU cores; {big['model']}: {big['gbps']:.2f} GB/s)."
        ),
        "",
    ]


if __name__ == "__main__":
    sys.exit(main_of(__doc__, SECTION, add_arguments, run))
