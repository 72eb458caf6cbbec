"""`python -m dsexp.sync SWEEP_DIR [--uri URI] [--experiment NAME]`: log a sweep's results into MLflow.

For when the tracking store was unreachable during the sweep: every job whose result.json has no
run id (its `tracking` holds the error instead) is logged now, as a child of the sweep's parent run
(created in that store if the sweep never got one). Jobs that already have a run id are left alone,
so running it twice logs nothing twice. Exit status 1 if some job still could not be logged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsexp.core.fs import read_json
from dsexp.tracking.runs import OFF, Tracker, ensure_parent, read_sweep_state, resolve_uri, track_job


def job_results(sweep_dir: Path) -> List[Tuple[Path, Dict[str, Any]]]:
    """(job folder, result) for every job of the sweep, in job order."""
    out = []
    for path in sorted(Path(sweep_dir).glob("*/result.json"), key=lambda p: (len(p.parent.name), p.parent.name)):
        res = read_json(path)
        if res:
            out.append((path.parent, res))
    return out


def _target(
    sweep_dir: Path, missing: List[Tuple[Path, Dict[str, Any]]], uri: Optional[str], experiment: Optional[str]
) -> Tuple[str, str]:
    """Where to log: the arguments, else the sweep's recorded store, else the store the jobs tried (a sweep run
    with tracking=none: the default store)."""
    state = read_sweep_state(sweep_dir) or {}
    tried = missing[0][1].get("tracking") or {}
    cfg = missing[0][1].get("config", {}).get("tracking", {})
    given = [uri, state.get("uri"), tried.get("uri"), cfg.get("uri")]
    uri = resolve_uri(next((u for u in given if u and u != OFF), None))
    return uri, experiment or state.get("experiment") or tried.get("experiment") or cfg.get("experiment") or "dsexp"


def sync_sweep(sweep_dir: Path, uri: Optional[str] = None, experiment: Optional[str] = None) -> Dict[str, List[str]]:
    """Log every job lacking a run id; returns job folders by outcome: logged, already, failed."""
    sweep_dir = Path(sweep_dir)
    results = job_results(sweep_dir)
    out: Dict[str, List[str]] = {"logged": [], "already": [], "failed": []}
    missing = []
    for job_dir, res in results:
        if (res.get("tracking") or {}).get("run_id"):
            out["already"].append(str(job_dir))
        else:
            missing.append((job_dir, res))
    if not missing:
        return out
    uri, experiment = _target(sweep_dir, missing, uri, experiment)
    try:
        tracker = Tracker(uri, experiment)
        state = ensure_parent(sweep_dir, tracker, experiment, {"dsexp.synced": "true"})
    except Exception as e:
        print(f"dsexp.sync: MLflow store {uri} unavailable: {type(e).__name__}: {e}", file=sys.stderr)
        out["failed"] = [str(j) for j, _ in missing]
        return out
    for job_dir, res in missing:
        track_job(res, job_dir, sweep_dir, uri, experiment)
        out["logged" if res["tracking"].get("run_id") else "failed"].append(str(job_dir))
    if state["created"] and not out["failed"]:
        tracker.set_status(state["run_id"], "FINISHED")
    return out


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m dsexp.sync", description=__doc__.split("\n\n")[0])
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--uri", help="tracking store (default: the sweep's, else the one its jobs tried)")
    ap.add_argument("--experiment", help="experiment name (default: the sweep's)")
    args = ap.parse_args(argv)
    if not args.sweep_dir.is_dir():
        ap.error(f"{args.sweep_dir} is not a folder")
    out = sync_sweep(args.sweep_dir, args.uri, args.experiment)
    print(f"dsexp.sync: {len(out['logged'])} logged, {len(out['already'])} already logged, {len(out['failed'])} failed")
    for job in out["failed"]:
        print(f"  not logged: {job}", file=sys.stderr)
    return 1 if out["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
