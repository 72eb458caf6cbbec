"""Preparing a software stack (section `stacks` of `make bench`): the seed's stack (transformers 4.42.4, DeepSpeed
0.14.4, ...) into an empty cache, then again from the cache.

    python benchmarks/stack_build.py [--wheelhouse DIR] [--machine NAME] [--out DIR]

From the package index (or `--wheelhouse DIR`): the first build's time split into building DeepSpeed's wheel,
resolving and installing; then the same stack again, 5 times, which must be a cache hit in well under a second. Kept
as the `stacks` section of results/<machine>/bench.json and bench.md (benchmarks/common.py).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from common import main_of, met, summary

SECTION = "stacks"
TARGET_HIT_S = 0.5  # the stack again, from the cache


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--wheelhouse", help="stacks: install from this folder instead of the package index")


def run(args: argparse.Namespace, work: Path) -> Dict[str, Any]:
    return measure(work, args.wheelhouse)


def measure(workdir: Path, wheelhouse: Optional[str] = None) -> Dict[str, Any]:
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
        "hit_s": summary(hits),
    }


def render(data: Dict[str, Any]) -> List[str]:
    sk = data[SECTION]
    hit = sk["hit_s"]["max"]
    return [
        "## Software stacks",
        "",
        f"The seed's stack ({', '.join(sk['packages'])}) prepared into an empty cache from the {sk['source']}: "
        f"first build **{sk['first_s']:.1f} s** (DeepSpeed wheel {sk['build_s']:.1f} s, resolving "
        f"{sk['plan_s']:.1f} s, installing {sk['install_s']:.1f} s; {sk['bytes'] / 2**20:.0f} MiB). "
        f"Again, cached: {sk['hit_s']['mean'] * 1000:.1f} ms (max {hit * 1000:.1f} ms of 5) -> target "
        f"< {TARGET_HIT_S:g} s: {met(hit, TARGET_HIT_S, 's')}.",
        "",
    ]


if __name__ == "__main__":
    sys.exit(main_of(__doc__, SECTION, add_arguments, run))
