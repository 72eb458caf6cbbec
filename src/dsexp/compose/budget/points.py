"""What a budget search's job measured, as the search's points: a job's result.json read back per batch.

Each job runs one configuration at one or more batches (a grid inside the job, dsexp.core.workload); its ranks
record each point's status (ok / oom / skipped) and figures. A point's device need is the busiest rank's: on a GPU
the allocator's reserved peak over the prefill and the decode plus what the process holds outside the allocator
(measured at the end of `start`); on a CPU run the simulated need the rank checked against the budget
(dsexp.rank.budget_cap). A point skipped because a smaller one ran out of memory is no run (the smaller one is the
boundary). A job that failed out of memory before any point (the weights do not fit under the cap) is out of memory at
all its batches; a job ended from outside (NOT_MEASURED) measured nothing and runs again when the search resumes; a
job that failed preparing the machine (RETRIED_ON_RESUME: the disk full while the checkpoint was written) stops its
configuration in that search and runs again when the search resumes, the machine mended; any other failure (wrong
output, a crash, a host out of memory) stops the configuration.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsexp.analysis.budget_runs import device_per_rank, host_need, not_as_load, point_phase
from dsexp.compose.budget.search import FAILED, OK, OOM, Point
from dsexp.core.fs import read_json
from dsexp.core.records import phase_kind
from dsexp.core.result import JobRecord

__all__ = ["host_need", "points_of", "not_as_load", "identity", "job_batches", "sweep_results", "read_json", "wall_s"]

GIB = 2**30
RESULT = "result.json"
# A job ended from outside (Ctrl-C, SLURM's time limit, a node lost): nothing measured, the search runs it again
NOT_MEASURED = ("interrupted", "time_limit", "slurm_cancelled", "node_failed")
# Failed before any rank ran, preparing the machine (no space for the checkpoint, a cache it could not write): it says
# nothing of the configuration, but running it again at once would fail again, so only a resumed search retries it
RETRIED_ON_RESUME = ("prepare_error",)


def identity(config: Dict[str, Any]) -> str:
    """A configuration's identity in the space: its settings without the batch, without how it is timed (warm-up
    calls and repeats change no byte the search bounds: the budget campaign dropped its warm-up and still resumes its
    records) and without what job_key drops, and without the settings left at their defaults, so that a record
    written before a key was added to the schema (a search resumed on a later commit) still finds its
    configuration."""
    d = json.loads(json.dumps(config, default=str))
    for k in ("tracking", "rerun", "timeout_s", "cache_dir"):  # cache_dir: where the machine keeps checkpoints
        d.pop(k, None)
    for k in ("batch_size", "warmup", "repeats", "bisect_from"):
        (d.get("generate") or {}).pop(k, None)
    (d.get("load") or {}).pop("shard_dir", None)  # where split files are kept, as cache_dir
    d = _without(d, _defaults())
    return hashlib.sha1(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def _defaults() -> Dict[str, Any]:
    from dataclasses import asdict

    from dsexp.core.schema import JobConfig

    return json.loads(json.dumps(asdict(JobConfig()), default=str))


def _without(d: Dict[str, Any], defaults: Dict[str, Any]) -> Dict[str, Any]:
    """d without the entries equal to their default (nested settings compared key by key)."""
    out = {}
    for k, v in d.items():
        base = defaults.get(k, object())
        if isinstance(v, dict) and isinstance(base, dict):
            rest = _without(v, base)
            if rest:
                out[k] = rest
        elif v != base:
            out[k] = v
    return out


def job_batches(config: Dict[str, Any]) -> List[int]:
    value = (config.get("generate") or {}).get("batch_size", 1)
    return sorted({int(b) for b in (value if isinstance(value, list) else [value])})


def wall_s(result: Dict[str, Any]) -> Optional[float]:
    """The job's wall time, seconds: preparing (a checkpoint written, the reference computed) and every launch."""
    wall = result.get("wall_s")
    return None if wall is None else round(float(wall), 1)


def sweep_results(sweep_dir: Path) -> List[Tuple[Path, Dict[str, Any]]]:
    """(job folder, result) of every job folder of the sweep (earlier attempts, kept under .dsexp/, are not runs);
    a job killed before it wrote its result is read from what its ranks recorded (cut_short)."""
    out = []
    for job_dir in sorted(p for p in Path(sweep_dir).glob("*") if p.is_dir() and not p.name.startswith(".")):
        res = read_json(job_dir / RESULT) or cut_short(job_dir)
        if res:
            out.append((job_dir, res))
    return out


def cut_short(job_dir: Path) -> Optional[Dict[str, Any]]:
    """A job whose process was killed before it wrote result.json (the search's process killed outright, its
    in-process job with it): its config (job.json) and what its ranks recorded, read as an interrupted job, so that a
    resumed batch search keeps the points it measured (points_of). None where no rank recorded anything."""
    from dsexp.core.protocol import JOB_FILE, rank_file

    job = read_json(Path(job_dir) / JOB_FILE)
    if not job:
        return None
    ranks = [read_json(rank_file(job_dir, r)) for r in range(int(job["config"].get("tp") or 1))]
    if not any(ranks):
        return None
    return {
        "status": "failed",
        "failure": {
            "cause": "interrupted",
            "message": "the job's process was killed before it wrote result.json; read back from its ranks' records",
        },  # fmt: skip
        "config": job["config"],
        "runtime": job.get("runtime") or {},
        "ranks": ranks,
        "job_dir": str(job_dir),
        "cut_short": True,
    }


def points_of(job_dir: Path, result: Dict[str, Any], resumed: bool = False) -> Tuple[List[Point], Optional[str]]:
    """The job's points, and why its configuration should not be pursued (None: go on); resumed: the job is an
    earlier search's, read back by a search that resumes it. A batch search inside one load that ended otherwise
    (a CUDA error the process cannot recover from, Ctrl-C, a time limit) keeps the points it measured before, and its
    configuration goes on in a fresh job from them; only a failed job that measured nothing stops it. A point of a
    one-load search that did not start with the allocator's state the load left is not the search's: the batch stays
    open, for a fresh load."""
    rec = JobRecord.of(result)
    batches = job_batches(result.get("config") or {})
    if not rec.ok:
        cause = rec.cause or "failed"
        before = measured_points(job_dir, result, rec, batches) if searched_in_load(result) else []
        if cause in NOT_MEASURED or (resumed and cause in RETRIED_ON_RESUME):
            return before, None  # a search ended from outside keeps its points: the next job goes on from them
        if cause == "oom_gpu" and not before:
            return [Point(b, OOM, job=str(job_dir)) for b in batches], None
        if before:
            return before, None
        return [
            Point(b, FAILED, job=str(job_dir)) for b in batches
        ], f"{cause}: {(rec.failure.get('message') or '')[:200]}"
    return measured_points(job_dir, result, rec, batches), None


def searched_in_load(result: Dict[str, Any]) -> bool:
    return ((result.get("config") or {}).get("generate") or {}).get("bisect_from") is not None


def measured_points(job_dir: Path, result: Dict[str, Any], rec: JobRecord, batches: List[int]) -> List[Point]:
    """The batches the job's ranks ran (ok, with the busiest rank's device need) or ran out of memory at."""
    points, uncounted = [], not_as_load(result)
    opened = first_point_phase(rec)
    for b in batches:
        statuses = {e.get("status") for rk in rec.ranks for e in rk.raw.get("points") or [] if e.get("batch") == b}
        phase = point_phase(result, b)
        if phase is None:  # not run, or skipped: a smaller batch ran out of memory
            continue
        if b in uncounted:
            continue  # it did not start as a fresh process would (dsexp.rank.workloads.pipeline.as_load): run again
        first = opened is None or phase == opened
        if "oom" in statuses:
            points.append(Point(b, OOM, job=str(job_dir), first=first))
        else:  # ran (a script's generate calls list no point statuses)
            needs = [n for n in device_per_rank(result, b) if n is not None]
            points.append(Point(b, OK, max(needs) if needs else None, job=str(job_dir), first=first))
    return points


def first_point_phase(rec: JobRecord) -> Optional[str]:
    """The phase of the point rank 0's process ran first, what a fresh process meets (None: the rank has no timeline
    of points). A relaunched job's timeline is its last process's: a point of an earlier launch is not that first."""
    rank = rec.ranks[0] if rec.ranks else None
    timeline = (rank.raw.get("timeline") or []) if rank else []
    ran = [e for e in timeline if phase_kind(e.get("phase") or "") == "generate"]
    return min(ran, key=lambda e: e.get("t0") or 0)["phase"] if ran else None
