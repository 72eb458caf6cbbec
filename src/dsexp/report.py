"""`python -m dsexp.report [SWEEP_DIR | --experiment NAME | --parent-run ID]`: the sweep report on demand.

From a folder: every result.json below it; the report goes into the folder and, if the folder is a
sweep with an MLflow parent run, to that run too. From MLflow: the job runs of an experiment or of one
sweep's parent run; the report goes into --out and to the parent run.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path
from typing import Dict, List, Optional

from dsexp.analysis.sections import NAMES as SECTIONS  # imports no torch, pandas or matplotlib


def parse(argv: Optional[List[str]]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m dsexp.report", description=__doc__.splitlines()[0])
    ap.add_argument(
        "sweep_dir",
        nargs="*",
        type=Path,
        help="a sweep folder (or a folder of sweeps); several budget searches of one budget: read as one (--out)",
    )
    src = ap.add_mutually_exclusive_group()
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
    ap.add_argument(
        "--check",
        action="store_true",
        help="check the reports below the folders (summary*.md): each rebuilt by the command its Source line names, "
        "from the repository's root, with today's code (no plots drawn) and compared; exit 1 naming each that differs",
    )
    ap.add_argument("--rewrite", action="store_true", help="with --check: write each that differs again, plots too")
    args = ap.parse_args(argv)
    if args.rewrite and not args.check:
        ap.error("--rewrite goes with --check")
    if args.check and not args.sweep_dir:
        ap.error("--check needs the folders whose reports it checks")
    if (len(args.sweep_dir) > 0) + (args.experiment is not None) + (args.parent_run is not None) != 1:
        ap.error("give one source: sweep folder(s), --experiment or --parent-run")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    from dsexp.core.compat import quiet_optional_imports

    quiet_optional_imports()
    args = parse(argv)
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):  # library chatter (DeepSpeed logs to stdout) stays off stdout
        return run(args, out)


def run(args: argparse.Namespace, out) -> int:
    from dsexp.tracking.runs import read_sweep_state, resolve_uri
    from dsexp.tracking.upload import report_sweep

    missing = [d for d in args.sweep_dir if not d.is_dir()]
    if missing:
        print(f"dsexp report: {missing[0]} is not a folder", file=sys.stderr)
        return 2
    if args.check:
        return check(args.sweep_dir, args.rewrite, out)
    if len(args.sweep_dir) > 1:
        return show(merged_report(args.sweep_dir, args.out), args.show, out)
    if args.sweep_dir:
        sweep = args.sweep_dir[0]
        parent = None if args.no_mlflow else read_sweep_state(sweep)
        source = str(sweep) + (f" --out {_shown(args.out)}" if args.out else "")
        return show(report_sweep(sweep, parent=parent, out_dir=args.out, source=source), args.show, out)
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


def merged_report(dirs: List[Path], out_dir: Optional[Path]) -> Optional[Dict[str, str]]:
    """Budget searches of one budget, answered as one search over their union (dsexp.analysis.budget_merge); the
    report goes to --out only (each search's own folder keeps its own report), attached to no MLflow run."""
    from dsexp.analysis.budget_merge import MergeError, read_merged
    from dsexp.analysis.summary import write_report

    if out_dir is None:
        print("dsexp report: several folders need --out: where their merged report goes", file=sys.stderr)
        return None
    try:
        search, results = read_merged(dirs)
    except MergeError as e:
        print(f"dsexp report: {e}", file=sys.stderr)
        return None
    out_dir.mkdir(parents=True, exist_ok=True)
    source = " ".join(_shown(d) for d in dirs) + f" --out {_shown(out_dir)}"
    return write_report(out_dir, results, out_dir, source, search=search)


def _shown(path: Path) -> str:
    """A folder as the report names it: relative to here where it lies below (a campaign passes absolute paths)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def check(folders: List[Path], rewrite: bool, out) -> int:
    """--check: each report below the folders against what its own command writes today; 1 if any differs (and is
    not written again). A report its command cannot rebuild (its Source names a folder outside the repository: a
    record of another machine's run) is named, and left as it is."""
    from dsexp.analysis.committed import Unchecked, differences, regenerate, reports_under

    root, bad = Path.cwd().resolve(), 0
    for report in (r.resolve() for folder in folders for r in reports_under(folder)):
        name = report.relative_to(root) if root in report.parents else report
        try:
            diff = differences(report, root)
        except Unchecked as e:
            print(f"{name}: not checked: {e}", file=out)
            continue
        print(f"{name}: {'differs from what the code writes today' if diff else 'as the code writes it'}", file=out)
        if diff:
            print("\n".join(f"    {line[:240]}" for line in diff[2:10]), file=out)
        if diff and rewrite:
            run(parse(shlex.split(regenerate(report, root).source) + ["--no-mlflow"]), sys.stderr)
        bad += bool(diff) and not rewrite
    return 1 if bad else 0


def show(parts: Optional[Dict[str, str]], section: Optional[str], out) -> int:
    """Exit status; prints the requested section (for docs generated from committed results)."""
    if parts is None:
        return 1
    if section and section not in parts:  # nothing to show, or a sweep's section in a budget search's report
        print(f"dsexp report: this report has no {section} section (it has: {', '.join(parts)})", file=sys.stderr)
        return 1
    if section:
        print(parts[section], file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
