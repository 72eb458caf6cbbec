"""The worker in a supporting role, before the measured ranks: the tp=1 `reference` and the `split` of load=sharded.

Both run the ordinary rank code (`dsexp.rank.worker`) on this node with torchrun and no fault injection; only
`runtime["workload"]` differs (dsexp.rank.workloads). A role run that fails raises, naming the rank and what it
reported, so the job records a prepare_error instead of measuring against a broken cache.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from dsexp.core.fs import read_json
from dsexp.core.protocol import rank_file, rank_log, write_job_file
from dsexp.core.schema import JobConfig
from dsexp.job.failures import tail
from dsexp.job.launch import run_ranks


class RoleFailed(RuntimeError):
    """A role run failed; `error` is what its failing rank recorded (type, message, phase), if anything."""

    def __init__(self, message: str, error: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.error = error or {}


def role_spec(spec: JobConfig, **changes: Any) -> JobConfig:
    """A copy of the job's settings for a role run: no fault injection (unless the fault says `roles: true`),
    torchrun, and `changes` on top."""
    out = copy.deepcopy(spec)
    out.fault = spec.fault if (spec.fault or {}).get("roles") else None
    out.launcher.name = "torchrun"
    for key, value in changes.items():
        obj, _, leaf = key.rpartition("__")
        setattr(getattr(out, obj) if obj else out, leaf, value)
    return out


def run_role(
    spec: JobConfig,
    runtime: Dict[str, Any],
    run_dir: Path,
    role: str,
    what: str,
    extra: Optional[Dict[str, Any]] = None,
    missing: Callable[[int], Optional[str]] = lambda rank: None,
) -> List[dict]:
    """Run the worker as `role` on spec.tp ranks in run_dir; return the rank records.

    missing(rank): what the rank should have left but did not (None: all there). Raises RoleFailed
    ("<what> failed on rank N (see run_dir): <error>") if any rank failed or left something missing."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_job_file(run_dir, spec, {**runtime, "workload": role, **(extra or {})})
    outcome = run_ranks(spec, run_dir, runtime["device"], stack=runtime.get("stack"))
    recs = []
    for r in range(spec.tp):
        rec = read_json(rank_file(run_dir, r))
        lacking = missing(r)
        if outcome.returncode != 0 or not rec or rec.get("status") != "ok" or lacking:
            error = (rec or {}).get("error")
            why = (
                f"{error.get('type')} in {error.get('phase')}: {error.get('message')}"
                if error
                else lacking or tail(rank_log(run_dir, r), 10)
            )
            raise RoleFailed(f"{what} failed on rank {r} (see {run_dir}): {why}", error)
        recs.append(rec)
    return recs
