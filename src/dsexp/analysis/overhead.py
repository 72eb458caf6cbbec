"""Where a job's wall time goes, from the timestamps in its result.json: the ranks' own work
(load + init + generate) and every step dsexp and the launchers add around it.

All marks are epoch seconds. The job records when Hydra handed over (`clock.task`), when it launched the
ranks and when the launcher exited and was torn down (`launch.clock`), when its result was complete
(`clock.ended`) and logged (`clock.tracked`); each rank records when its process was created, the epoch
of its timeline's zero and when its record was complete (`clock`), and how long its imports took inside
the start phase. The
critical path is followed through the rank that finished generating last.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.core.result import JobRecord, Phase, RankRecord

# (segment, from mark, to mark, what it is); consecutive, so the segments add up to the job's wall time.
SEGMENTS = (
    (
        "prepare",
        "task",
        "popen",
        "job preparation: validation, resume check, caches (checkpoint, reference, split), job.json, baseline",
    ),
    ("launcher_start", "popen", "created", "launcher start: torchrun/deepspeed starts and spawns the rank processes"),
    (
        "rank_startup",
        "created",
        "imported",
        "rank start-up: interpreter, dsexp, torch and DeepSpeed imports (slowest rank)",
    ),
    ("rendezvous", "imported", "started", "device and process group: CUDA device, init_distributed"),
    ("rank_work", None, None, "the ranks' own work: load + init + generate wall time"),
    ("rank_probes", None, None, "in-rank recording between phases: weight census, snapshots, rank file writes"),
    ("rank_wrapup", "work_end", "finished", "after generate: its probes, logits and rank file written (slowest rank)"),
    ("rank_exit", "finished", "exited", "the ranks' processes and the launcher exit"),
    ("teardown", "exited", "done", "teardown: survivors reaped, ports checked, shared memory removed"),
    (
        "aggregate",
        "done",
        "ended",
        "aggregation: rank records, metrics, failure check, correctness, trace.json, result.json",
    ),
    ("mlflow", "ended", "tracked", "MLflow logging: run, params, metrics, artifacts"),
)
DESCRIPTIONS = {name: text for name, _, _, text in SEGMENTS}
OWN_WORK = "rank_work"
NOT_DSEXP = ("launcher_start", "rank_startup", "rendezvous")  # any torchrun + DeepSpeed job pays these too


def _last_rank(ranks: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    done = [r for r in ranks if r and r.get("clock") and RankRecord(r).phase(Phase.GENERATE).recorded]
    return max(done, key=lambda r: _at(r, "generate", "t1")) if done else None


def _at(rank: Dict[str, Any], phase: str, end: str) -> float:
    t = next(e[end] for e in rank["timeline"] if e["phase"] == phase)
    return rank["clock"]["t0"] + t


def marks(result: Dict[str, Any]) -> Optional[Dict[str, float]]:
    """The job's marks (epoch seconds), or None for a result without them (failed, older schema)."""
    ranks = [rk.raw for rk in JobRecord.of(result).ranks if rk.clock]
    last, clock, launch = _last_rank(ranks), result.get("clock") or {}, (result.get("launch") or {}).get("clock") or {}
    if last is None or not {"task", "tracked"} <= set(clock) or not launch.get("exited"):
        return None
    return {
        "task": clock["task"],
        "popen": launch["popen"],
        "created": min(r["clock"]["created"] for r in ranks),
        "imported": max(
            r["clock"]["t0"] + (RankRecord(r).phase(Phase.START).raw.get("imports_s") or 0.0) for r in ranks
        ),
        "started": _at(last, "start", "t1"),
        "work_end": _at(last, "generate", "t1"),
        "finished": max(r["clock"].get("finished", launch["exited"]) for r in ranks),
        "exited": launch["exited"],
        "done": launch["done"],
        "ended": clock["ended"],
        "tracked": clock["tracked"],
        "work_s": sum(RankRecord(last).phase(p).wall_s for p in (Phase.LOAD, Phase.INIT, Phase.GENERATE)),
    }


def breakdown(result: Dict[str, Any], previous: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, float]]:
    """Seconds per segment (SEGMENTS), `total`, and `overhead` = total - rank_work.

    previous: the job the same Hydra process ran just before; the gap since it was logged is Hydra's own
    per-job work (composing the job's config, its output folder and logging) and counts as `hydra`."""
    mk = marks(result)
    if mk is None:
        return None
    out = {name: mk[b] - mk[a] for name, a, b, _ in SEGMENTS if a}
    out["rank_work"] = mk["work_s"]
    out["rank_probes"] = mk["work_end"] - mk["started"] - mk["work_s"]
    prev = marks(previous) if previous else None
    if prev:
        out["hydra"] = mk["task"] - prev["tracked"]
    out["total"] = mk["tracked"] - mk["task"] + out.get("hydra", 0.0)
    out["overhead"] = out["total"] - out["rank_work"]
    out["overhead_dsexp"] = out["overhead"] - sum(out[k] for k in NOT_DSEXP)
    return out
