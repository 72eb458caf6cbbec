"""A launch whose ranks ended because a rank ran out of memory where its peers could not follow
(dsexp.rank.oom_agreement): how every rank ended, the grid's points left, and what each launch recorded, kept.

The rank that ran out records the point and exits; the launcher stops its peers (they wait in a collective), so the
launch ends within launcher.grace_s. Each peer's record then says how it ended (`ended`: torn down after rank k ran
out of memory at point X) and lists that point as out of memory. The grid's points not yet run and not dominated by
a point that ran out (dsexp.core.workload.dominated) are run by launching the ranks again for just those (one more
load, within what the job's timeout_s has left); every such launch adds a point that ran out, so there are fewer
relaunches than points. Nothing recorded is lost: a launch's rank folder and launcher.log move to
.dsexp/launches/<n>/, and the final rank records carry every launch's points and point phases (`earlier_launches`
says how each earlier launch ended).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from dsexp.core.bisect import next_point
from dsexp.core.fs import write_json_atomic
from dsexp.core.protocol import logits_file, rank_file
from dsexp.core.workload import Point, dominated, grid, parse_phase
from dsexp.job import failures

LAUNCHES = Path(".dsexp") / "launches"


def ended_by_oom(ranks: Sequence[Optional[dict]]) -> Optional[Dict[str, Any]]:
    """The `ended` of the (lowest) rank that ended the ranks after running out of memory, if one did."""
    ends = [r["ended"] for r in ranks if r and (r.get("ended") or {}).get("how") == "oom"]
    return min(ends, key=lambda e: e["rank"]) if ends else None


def mark_torn_down(job_dir: Path, ranks: List[Optional[dict]], ended: Dict[str, Any]) -> None:
    """Every other rank's record says it was torn down after `ended`'s rank ran out of memory, and lists that
    point as out of memory (rewritten in its file too). An error it recorded in that point's phase, or one that
    only says a peer went away, is the teardown's, kept under `ended`; any other error stays its own."""
    for r, rec in enumerate(ranks):
        if rec is None:
            rec = ranks[r] = {"rank": r, "status": "running", "phases": {}, "timeline": [], "error": None}
        if rec.get("ended"):
            continue
        error = rec.get("error")
        if error and error.get("phase") != ended["phase"] and not failures.only_a_peer_went_away(error):
            continue
        rec["ended"] = {
            "how": "torn_down",
            "after_rank": ended["rank"],
            "phase": ended["phase"],
            "point": ended["point"],
            "message": f"rank {r} was torn down at {ended['phase']} after rank {ended['rank']} ran out of memory "
            "there and ended the job's ranks",
            **({"error": error} if error else {}),
        }
        rec.update(error=None, status="ok")
        entry = {**ended["point"], "phase": ended["phase"], "status": "oom", "oom_ranks": ended["oom_ranks"]}
        rec["points"] = [*(rec.get("points") or []), {**entry, "torn_down": True}]
        rec["phases"].setdefault(ended["phase"], {})["point"] = {**ended["point"], "torn_down": rec["ended"]}
        write_json_atomic(rank_file(job_dir, r), rec)


def points_left(generate: Any, launches: Sequence[Sequence[Optional[dict]]]) -> List[Point]:
    """The grid's points no launch recorded and no point that ran out dominates, in the order they run; of a batch
    search (generate.bisect_from), the next point it runs (none: settled)."""
    entries = recorded_points(launches)
    if getattr(generate, "bisect_from", None) is not None:
        point = next_point(generate, entries)
        return [] if point is None else [point]
    done = {(e["batch"], e["prompt_tokens"]) for e in entries}
    ran_out = [Point(e["batch"], e["prompt_tokens"]) for e in entries if e["status"] == "oom"]
    return [p for p in grid(generate) if (p.batch, p.prompt_tokens) not in done and not dominated(p, ran_out)]


def recorded_points(launches: Sequence[Sequence[Optional[dict]]]) -> List[Dict[str, Any]]:
    """Every point entry the launches' rank records hold (what a relaunched batch search goes on from)."""
    return [e for ranks in launches for rec in ranks if rec for e in rec.get("points") or []]


def archive_launch(job_dir: Path, ranks: Sequence[Optional[dict]], launch: Dict[str, Any], left: List[Point]) -> dict:
    """Move the launch's rank folder and launcher.log to .dsexp/launches/<n>/ (the first point's logits stay for
    the correctness check); return the launch's summary for result.json's `launches`."""
    job_dir = Path(job_dir)
    dest = job_dir / LAUNCHES / str(len(list((job_dir / LAUNCHES).glob("*"))) + 1)
    dest.mkdir(parents=True)
    (job_dir / "ranks").rename(dest / "ranks")
    if (job_dir / "launcher.log").exists():
        (job_dir / "launcher.log").rename(dest / "launcher.log")
    logits = logits_file(dest)
    if logits.exists():
        logits_file(job_dir).parent.mkdir(parents=True, exist_ok=True)
        logits.rename(logits_file(job_dir))
    return {
        "dir": str(dest),
        "ended": ended_by_oom(ranks),
        "ranks": {f"rank{r}": (rec or {}).get("ended") for r, rec in enumerate(ranks)},
        "returncode": launch.get("returncode"),
        "wall_s": launch.get("wall_s"),
        "clock": launch.get("clock"),
        "teardown": launch.get("teardown"),
        "relaunched_for": [p.to_dict() for p in left],
    }


def merge_launches(
    earlier: Sequence[Sequence[Optional[dict]]], ranks: List[Optional[dict]], generate: Any
) -> List[Optional[dict]]:
    """The last launch's rank records with every earlier launch's points and point phases, each record's points
    completed over the grid (`skipped` where a point that ran out dominates it, `not_run` where no launch ran it)."""
    for r, rec in enumerate(ranks):
        if rec is None:
            continue
        points = list(rec.get("points") or [])
        rec["earlier_launches"] = []
        for n, launch in enumerate(earlier, 1):
            old = launch[r] if r < len(launch) else None
            if old is None:
                continue
            points += old.get("points") or []
            for key, phase in (old.get("phases") or {}).items():
                if parse_phase(key):
                    rec["phases"].setdefault(key, phase)
            rec.setdefault("generate", old.get("generate"))
            rec["earlier_launches"].append({"launch": n, "ended": old.get("ended"), "clock": old.get("clock")})
        rec["points"] = complete_points(points, generate)
    return ranks


def not_run_why(generate: Any) -> str:
    if getattr(generate, "bisect_from", None) is not None:
        return "the batch search settled without it"
    return "no launch of the job reached it"


def complete_points(points: List[Dict[str, Any]], generate: Any) -> List[Dict[str, Any]]:
    """A rank's point entries in the grid's order, one per grid point: those recorded, then `skipped` (larger than
    one that ran out) or `not_run` for the rest."""
    full = grid(generate)
    by_point = {(e["batch"], e["prompt_tokens"]): e for e in points}
    ran_out = [Point(e["batch"], e["prompt_tokens"]) for e in points if e["status"] == "oom"]
    out = []
    for p in full:
        entry = by_point.get((p.batch, p.prompt_tokens))
        if entry is None:
            larger = dominated(p, ran_out)
            key = p.phase(len(full) == 1)
            entry = (
                {**p.to_dict(), "phase": key, "status": "skipped", "larger_than": larger.to_dict()}
                if larger
                else {**p.to_dict(), "phase": key, "status": "not_run", "why": not_run_why(generate)}
            )
        out.append(entry)
    return out
