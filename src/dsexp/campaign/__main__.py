"""`python -m dsexp.campaign NAME [--dry-run] [--only STEPS] [--add OVERRIDE]... [--out DIR] [--work DIR] [--resume]
[--within SECONDS [--min-step SECONDS]] [--bundle TAR_GZ]`.

Runs the campaign's steps in order and fills its results folder (--out: elsewhere); --dry-run prints the commands;
--add appends an override to every sweep (`--add hydra/launcher=dsexp_slurm`); --list names every campaign;
--resume starts each sweep from the results folder's records (a budget search cut short on another machine goes on),
or from an earlier work folder of the campaign where that holds more.
--within ends the campaign that many seconds after it starts, for a machine held for a call of limited length: a step
is not started with less than --min-step seconds left, a running one is stopped as at its own limit.
Exit status 1 if a step failed or ran out of time (the steps after it still run); 130 if the campaign was stopped
(Ctrl-C, SIGTERM, --within): the running step is stopped, what it measured copied and recorded, the steps after it
not run."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

from dsexp.campaign.runner import bundle, run_campaign, selected
from dsexp.campaign.spec import REPO, load, names
from dsexp.core.schema import ConfigError

WORK_ENV = "DSEXP_CAMPAIGN_WORK"  # where campaigns' sweeps run by default (scripts/gpu/env.sh: /tmp/campaigns)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsexp.campaign", description=__doc__.splitlines()[0])
    ap.add_argument("name", nargs="?", help="a campaign: campaigns/<name>.yaml")
    ap.add_argument("--list", action="store_true", help="every campaign, its results folder and what it needs")
    ap.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    ap.add_argument("--only", help="comma-separated step names (default: every step)")
    ap.add_argument("--add", action="append", default=[], metavar="OVERRIDE", help="appended to every sweep, wins")
    ap.add_argument("--out", type=Path, help="results folder (default: the campaign's, e.g. results/h200/shared)")
    work_help = f"sweeps run here (default: ${WORK_ENV} or multirun/campaigns, then <name>/<time>)"
    ap.add_argument("--work", type=Path, help=work_help)
    resume_help = (
        "start each sweep from the results folder's records (another machine's) or an earlier work folder's, "
        "whichever holds more: ok jobs are skipped"
    )
    ap.add_argument("--resume", action="store_true", help=resume_help)
    bundle_help = (
        "at the end (stopped too), a tar.gz of the steps' compact results and campaign.json, named as in the repo: "
        "for a machine whose checkout is gone after the command"
    )
    ap.add_argument("--bundle", type=Path, metavar="TAR_GZ", help=bundle_help)
    within_help = "end the campaign this many seconds after it starts (keep an outer limit ~60 s longer)"
    ap.add_argument("--within", type=float, metavar="SECONDS", help=within_help)
    min_help = "with --within: do not start a step with less than this left (default 120)"
    ap.add_argument("--min-step", type=float, default=120.0, metavar="SECONDS", help=min_help)
    args = ap.parse_args(argv)
    if args.within is not None and args.within <= 0:
        ap.error(f"--within must be a positive number of seconds, got {args.within:g}")
    # SIGTERM (a SLURM time limit, `timeout`) stops the running step as Ctrl-C does: its results are copied first
    signal.signal(signal.SIGTERM, _interrupt)
    if args.list or not args.name:
        for name in names():
            c = load(name)
            print(f"{name:22s} {c.results:32s} {c.machine}{' (frozen)' if c.frozen else ''}")
        return 0 if args.list else 2
    try:
        campaign = load(args.name)
        out = (args.out or REPO / campaign.results).resolve()
        root = Path(os.environ.get(WORK_ENV) or REPO / "multirun" / "campaigns")
        work = (args.work or root / args.name / time.strftime("%Y-%m-%d_%H-%M-%S")).resolve()
        only = args.only.split(",") if args.only else None
        steps = [s.name for s in selected(campaign, only)]
        try:
            return run_campaign(
                campaign, out, work, dry_run=args.dry_run, only=only, add=args.add, resume=args.resume,
                within_s=args.within, min_step_s=args.min_step,
            )  # fmt: skip
        finally:
            if args.bundle and not args.dry_run:
                print(f"# bundle {args.bundle}: {', '.join(bundle(out, steps, args.bundle)) or 'nothing'}", flush=True)
    except ConfigError as e:
        print(f"dsexp.campaign: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
