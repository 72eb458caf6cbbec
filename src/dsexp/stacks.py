"""`python -m dsexp.stacks fill DIR [stack=seed] [stack.transformers=4.46.3 ...] [--python-version 3.12 --torch 2.11.0]`
fills a wheelhouse for offline machines (then run there with `stack.wheelhouse=DIR`);
`python -m dsexp.stacks fill-job DIR [--python-version 3.12]` fills one with the wheels dsexp's own job environment
needs on a GPU machine whose image lacks DeepSpeed, Hydra, OmegaConf, MLflow and pydantic (docs/gpu.md);
`python -m dsexp.stacks prepare [overrides]` prepares a stack now, as a sweep would before its first job.
Overrides are the ones `python -m dsexp` takes (only the stack and cache_dir matter)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsexp.stacks", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fill", help="download a stack's wheels (torch excluded) into a folder")
    j = sub.add_parser("fill-job", help="download and build the wheels of dsexp's job environment for a GPU machine")
    for q in (f, j):
        q.add_argument("folder")
        q.add_argument("--python-version", help="the target's Python, e.g. 3.12 (default: this one)")
        q.add_argument("--platform", action="append", default=[], help="pip platform tags of the target")
    f.add_argument("--torch", help="the target's torch version (default: this environment's)")
    p = sub.add_parser("prepare", help="prepare (or find cached) a stack under cache_dir")
    for q in (f, p):
        q.add_argument("overrides", nargs="*", help="e.g. stack=seed stack.transformers=4.46.3")
    args = ap.parse_args(argv)

    from dsexp.job.overlay import StackError, fill, fill_job, prepare_stack

    try:
        if args.cmd == "fill-job":
            wheels = fill_job(args.folder, args.python_version, args.platform)
            print(f"dsexp.stacks: {len(wheels)} wheels in {args.folder}:\n  " + "\n  ".join(wheels))
            return 0
        from dsexp.compose.config import compose_app, to_schema

        spec = to_schema(compose_app(args.overrides))
        if args.cmd == "fill":
            wheels = fill(spec.stack, args.folder, args.python_version, args.torch, args.platform)
            print(f"dsexp.stacks: {len(wheels)} wheels in {args.folder}:\n  " + "\n  ".join(wheels))
        else:
            print(json.dumps(prepare_stack(spec.stack, spec.cache_dir), indent=1))
    except StackError as e:
        print(f"dsexp.stacks: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
