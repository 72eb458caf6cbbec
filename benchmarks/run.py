"""`make bench`: how fast dsexp itself is on this machine, and how much it disturbs what it measures.

    python benchmarks/run.py [--machine NAME] [--only imports,writer,overhead,sampler,series,stacks] [--big]
                             [--pairs N] [--sampler-model tiny|small] [--overhead-jobs N] [--out DIR] [--keep DIR] ...

Runs the benchmarks of results/<machine>/bench.json and bench.md (machine: `cpu`, or `h200` / `h200x2` from NVML's
GPU name and count) in this order, one section each, in one temporary work folder (the jobs' cache, empty at the
start, and MLflow store): each is one file of benchmarks/ that runs alone too (`make benchmark NAME=job_overhead`),
and its docstring says what it measures:

- imports: rank_startup.py, a rank's start-up (a fresh interpreter importing what a rank imports, step by step);
- writer: checkpoint_writer.py, the random-weight checkpoint writer's GB/s;
- overhead: job_overhead.py, the time dsexp adds to each job, and its caches across a sweep;
- sampler: sampler_on_off.py, the peak sampler's CPU and its effect on phase times, on paired jobs;
- series: memory_series.py, the memory series' own cost;
- stacks: stack_build.py, preparing the seed's software stack, then finding it cached.

bench.json and bench.md are rewritten after every section; a run with --only updates those sections and keeps the
others (benchmarks/common.py). Every benchmark's options are taken here.
"""

from __future__ import annotations

import importlib
import sys

from common import SECTIONS, parser, run_sections


def main() -> int:
    ap = parser(__doc__)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma-separated sections of {', '.join(SECTIONS)}")
    modules = {name: importlib.import_module(module) for name, module in SECTIONS.items()}
    for module in modules.values():
        module.add_arguments(ap)
    args = ap.parse_args()
    only = [s for s in args.only.split(",") if s]
    unknown = set(only) - set(SECTIONS)
    if unknown:
        ap.error(f"unknown sections: {', '.join(sorted(unknown))}")
    return run_sections([(name, modules[name].run) for name in SECTIONS if name in only], args)


if __name__ == "__main__":
    sys.exit(main())
