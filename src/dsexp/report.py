"""`python -m dsexp.report [SWEEP_DIR | --experiment NAME | --parent-run ID]`: the sweep report on demand.

From a folder: every result.json below it; the report goes into the folder and, if the folder is a
sweep with an MLflow parent run, to that run too. From MLflow: the job runs of an experiment or of one
sweep's parent run; the report goes into --out and to the parent run.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path
from typing import Dict, List, Optional

from dsexp.analysis.sections import NAMES as SECTIONS  # imports no torch, pandas or matplotlib


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dsexp.report", description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("sweep_dir", nargs="?", type=Path, help="a sweep folder (or a folder of sweeps)")
    src.add_argument("--experiment", help="MLflow experiment name: report on all its job runs")
    src.add_argument("--parent-run", help="MLflow run id of a sweep's parent run")
    ap.add_argument("--tracking-uri", help="MLflow store (default: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    ap.add_argument(
        "--out",
        type=Path,
        help="where to write the report (default: the sweep folder, or "
        "./report-<experiment or run id> for MLflow sources)",
    )
    ap.add_argument("--no-mlflow", action="store_true", help="do not attach the report to an MLflow parent run")
    ap.add_argument(
        "--print",
        dest="show",
        choices=SECTIONS,
        help="also print one section of summary.md to stdout (e.g. to generate docs from committed results)",
    )
    return ap.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    args = parse(argv)
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # library chatter (DeepSpeed logs to stdout) stays off stdout
        return run(args, out)


def run(args: argparse.Namespace, out) -> int:
    from dsexp.tracking.runs import read_sweep_state, resolve_uri
    from dsexp.tracking.upload import report_sweep

    if args.sweep_dir is not None:
        if not args.sweep_dir.is_dir():
            print(f"dsexp report: {args.sweep_dir} is not a folder", file=sys.stderr)
            return 2
        parent = None if args.no_mlflow else read_sweep_state(args.sweep_dir)
        return show(
            report_sweep(args.sweep_dir, parent=parent, out_dir=args.out, source=str(args.sweep_dir)), args.show, out
        )
    from dsexp.tracking.readback import results_from_mlflow

    uri = resolve_uri(args.tracking_uri)
    results, parent = results_from_mlflow(uri, args.experiment, args.parent_run)
    name = args.experiment or args.parent_run
    folder = args.out or Path(f"report-{name}")
    source = f"--experiment {args.experiment}" if args.experiment else f"--parent-run {args.parent_run}"
    return show(
        report_sweep(folder, parent=None if args.no_mlflow else parent, results=results, out_dir=folder, source=source),
        args.show,
        out,
    )


def show(parts: Optional[Dict[str, str]], section: Optional[str], out) -> int:
    """Exit status; prints the requested section (for docs generated from committed results)."""
    if parts is None:
        return 1
    if section:
        print(parts[section], file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
