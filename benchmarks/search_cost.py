"""What a budget search costs with one load per configuration, against the committed H200 searches that loaded the
model at every guess: loads, points and wall time per configuration.

    make benchmark NAME=search_cost   (or: .venv/bin/python benchmarks/search_cost.py)

Reads every committed H200 budget search (results/h200/budget/*/budget.json and its jobs' result.json: InternLM2 at
20B shapes, AutoTP, tp=2 and 4 with the ranks sharing one H200, each capped at 24 or 40 GiB, 2048-token prompts).
For each configuration that bracketed its batch:

- committed: the jobs (each a load) and points it ran, and their wall time (each job's result.json `wall_s`);
- one load: the search as dsexp now runs it (dsexp.compose.budget.search with one_load, its first guess the memory
  model's allocated answer held to the allocator's replay, dsexp.predict.job.replayed) against the bracket the H200
  measured (a batch runs where it is at most the largest that ran): the loads and points it takes (dsexp.core.bisect);
  its wall time ESTIMATED from the committed jobs' own measured times: one job's fixed cost (its wall time less its
  points' phases, the mean over the configuration's jobs) plus, per point, the measured phase time at that batch
  where a job ran it, else the mean over the configuration's points.

Nothing here runs on a GPU: the one-load figures are what the committed measurements imply, not a new measurement.
The campaign `budget`'s steps gpu40_one_load and gpu24_one_load measure them; once their folders are committed
under results/h200/budget, each configuration they searched is also set beside the committed searches of the same
budget, measured against measured (issue 45): the bracket each found (the same, or both shown), the loads, points and
wall time each spent, and every point a job ran after another of its own (after one that ran out of memory its
cache was always released; after one that ran, only from the commit that empties it before every point, which the
point's record says with its `start`) against a fresh process that ran the same batch first: status and reserved
peak.
Writes results/cpu/search_cost.{json,md}.
"""

from __future__ import annotations

import functools
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).parent))

from common import table  # noqa: E402

from dsexp.core.result import JobRecord  # noqa: E402

BUDGET = ROOT / "results" / "h200" / "budget"
OUT = ROOT / "results" / "cpu" / "search_cost"
GIB = 2**30
SEARCHES = ("gpu24", "gpu24_loads_tp2", "gpu24_loads_tp4", "gpu40", "gpu40_expandable")
# each one-load search (campaign budget) -> the committed searches, a load per guess, of the same budget
ONE_LOAD = {"gpu40_one_load": ("gpu40",), "gpu40_from_load": ("gpu40",),
            "gpu24_one_load": ("gpu24", "gpu24_loads_tp2", "gpu24_loads_tp4"),
            # llama_20b_shapes: no budget search before (tp=1 at 48 GiB was probed by hand, results/h200/fragmentation)
            "llama48_tp1": (), "llama24_tp2": (), "llama24_tp2_confirm": (),
            # 4 x 19 GiB at tp=4 on an H100 (no load-per-guess search of it): the logits call at the point's batch,
            # then of the first sequence alone, then with the answer confirmed as a fresh load's first point
            "gpu19_tp4_one_load": (), "gpu19_tp4_first_sequence": (), "gpu19_tp4_confirm": ()}  # fmt: skip
# a step run only as the fresh-process reference for a one-load search's point after an out-of-memory one
FRESH = {"llama24_tp2": ("llama24_tp2_fresh",)}


def local(job_dir: str, search: str) -> Optional[Path]:
    """A job folder the search recorded (a path on the H200) as committed under results/h200/budget/<search>/."""
    path = BUDGET / search / Path(job_dir).name / "result.json"
    return path if path.is_file() else None


def point_seconds(result: Dict[str, Any]) -> Dict[int, float]:
    """batch -> the seconds its point's phase took on rank 0 (the points that ran or ran out of memory)."""
    from dsexp.core.workload import parse_phase

    rank0 = (result.get("ranks") or [None])[0] or {}
    out = {}
    for e in rank0.get("timeline") or []:
        point = parse_phase(e.get("phase") or "")
        if point is not None and e.get("t1") is not None:
            out[point.batch] = e["t1"] - e["t0"]
    return out


def reserved_by_batch(result: Dict[str, Any]) -> Dict[int, int]:
    """batch -> the highest reserved peak over the job's ranks during that point's phase (a job of one point may name
    its phase plain `generate`)."""
    from dsexp.core.workload import parse_phase

    out: Dict[int, int] = {}
    for rank in result.get("ranks") or []:
        points = rank.get("points") or []
        for name, phase in (rank.get("phases") or {}).items():
            point = parse_phase(name)
            batch = point.batch if point else points[0]["batch"] if name == "generate" and len(points) == 1 else None
            peak = ((phase or {}).get("gpu") or {}).get("gpu_reserved_peak")
            if batch is not None and peak is not None:
                out[batch] = max(out.get(batch, 0), peak)
    return out


def ran_in_order(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Rank 0's points in the order the job ran them (none skipped)."""
    rank0 = (result.get("ranks") or [None])[0] or {}
    return [p for p in rank0.get("points") or [] if p.get("status") in ("ok", "oom")]


def search_jobs(search: str, entry: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The result.json of every job a configuration's search ran, as committed."""
    jobs = sorted({p["job"] for p in entry["points"]})
    return [json.loads(p.read_text()) for p in (local(j, search) for j in jobs) if p]


def read_searches(searches) -> List[Tuple[str, Dict[str, Any], List[Dict[str, Any]]]]:
    """(search, configuration entry, its jobs' results) of every configuration of these searches, read once."""
    return [
        (search, entry, search_jobs(search, entry))
        for search in searches
        for entry in json.loads((BUDGET / search / "budget.json").read_text())["configs"]
    ]


def identity(entry: Dict[str, Any]) -> Tuple[str, str, str, bool]:
    """What a configuration is, whichever dimensions its search varied (a key names only those): tp, load, trim and
    whether its ranks ran with expandable segments."""
    from dsexp.analysis.sections.budget_answer import expandable

    given = dict(o.split("=", 1) for o in entry.get("overrides") or [] if "=" in o)
    return (
        given.get("tp", str(entry.get("tp", 1))),
        given.get("load", "-"),
        given.get("trim", "none"),
        expandable(entry),
    )


def fresh_points(read) -> Dict[Tuple, Dict[int, Dict[str, Any]]]:
    """configuration -> batch -> the status and reserved peak of a job that ran that batch first (a fresh
    process)."""
    out: Dict[Tuple, Dict[int, Dict[str, Any]]] = {}
    for search, entry, results in read:
        for result in results:
            first = ran_in_order(result)[:1]
            if first:
                b = first[0]["batch"]
                fresh = {"status": first[0]["status"], "reserved": reserved_by_batch(result).get(b), "from": search}
                out.setdefault(identity(entry), {})[b] = fresh
    return out


def after_another(result: Dict[str, Any]) -> List[Tuple[Dict[str, Any], Dict[str, Any]]]:
    """(the point before, the point) for each point a job ran after another of its own."""
    points = ran_in_order(result)
    return list(zip(points, points[1:]))


def cache_emptied(before: Dict[str, Any], point: Dict[str, Any]) -> bool:
    """Whether the point started from an emptied cache: always after an out-of-memory point; after one that ran,
    where its record has a `start` (dsexp.rank.workloads.pipeline empties the cache before every point since)."""
    return before["status"] == "oom" or "start" in point


def committed_by_config(read) -> Dict[Tuple, Dict[str, Any]]:
    """configuration -> the committed search's bracket, loads, points and wall time (the searches of one budget)."""
    return {
        identity(entry): {
            "search": search,
            "config": entry["key"],
            "bracket": [entry.get("largest_ok"), entry.get("smallest_oom")],
            "loads": len({p["job"] for p in entry["points"]}),
            "points": len(entry["points"]),
            "wall_s": round(sum(r["wall_s"] for r in results), 1),
        }
        for search, entry, results in read
        if entry.get("largest_ok") is not None or entry.get("smallest_oom") is not None
    }


@functools.lru_cache(maxsize=None)
def campaign_runs(path: Path) -> Tuple[Dict[str, Any], ...]:
    """The campaign's recorded runs (campaign.json), read once per benchmark run."""
    return tuple(json.loads(path.read_text())["runs"]) if path.is_file() else ()


def gpu_of(step: str, started: Optional[float] = None) -> str:
    """The GPU of the campaign's latest run of this step (campaign.json) that started before `started` (a job's
    start: a folder resumed on another machine holds jobs of both), '-' where none is recorded."""
    runs = campaign_runs(BUDGET / "campaign.json")
    gpus = [r["machine"]["gpus"] for r in runs if step in [s["name"] for s in r["steps"]] and r["machine"].get("gpus")
            and (started is None or r.get("started") is None or r["started"] <= started)]  # fmt: skip
    return gpus[-1][0].split(",")[0] if gpus else "-"


def first_guess(results: List[Dict[str, Any]]) -> Optional[int]:
    """The batch a one-load job started from (generate.bisect_from of its configuration's first job)."""
    for result in results:
        guess = ((result.get("config") or {}).get("generate") or {}).get("bisect_from")
        if guess is not None:
            return guess
    return None


def measured_rows(one_load: str, committed: Tuple[str, ...]) -> List[Dict[str, Any]]:
    """Each configuration the one-load search settled, beside the committed searches of its budget (empty until the
    one-load search is committed). A point run after another of the same load is held to a fresh process that ran
    the same batch first: a later load of the same search (its answer confirmed as a load's first point: the same
    code), else a job of the committed searches or of a step run for that reference alone (FRESH)."""
    if not (BUDGET / one_load / "budget.json").is_file():
        return []
    read = read_searches(committed)
    references = [s for s in FRESH.get(one_load, ()) if (BUDGET / s / "budget.json").is_file()]
    before, fresh = committed_by_config(read), fresh_points(read + read_searches(references))
    mine = read_searches((one_load,))  # its jobs read once: for its rows and for its own fresh points
    own = fresh_points(mine)
    rows = []
    for _, entry, results in mine:
        if not entry["points"]:
            continue
        row = {
            "search": one_load,
            "config": entry["key"],
            "gpu": " + ".join(dict.fromkeys(gpu_of(one_load, r.get("started")) for r in results)) or "-",
            "guess": first_guess(results),
            "bracket": [entry.get("largest_ok"), entry.get("smallest_oom")],
            "loads": len({p["job"] for p in entry["points"]}),
            "points": len(entry["points"]),
            "wall_s": round(sum(r["wall_s"] for r in results), 1),
            "committed": before.get(identity(entry)),
            "in_load": [],
        }
        row["same_answer"] = row["committed"] is not None and row["committed"]["bracket"] == row["bracket"]
        for result in results:
            in_process = reserved_by_batch(result)
            for prior, p in after_another(result):
                other = own.get(identity(entry), {}).get(p["batch"]) or fresh.get(identity(entry), {}).get(p["batch"])
                other = other or {}
                row["in_load"].append({
                    "batch": p["batch"],
                    "after": f"{prior['batch']} {prior['status']}",
                    "cache_emptied": cache_emptied(prior, p),
                    "status": p["status"],
                    "reserved_in_process": in_process.get(p["batch"]),
                    "status_fresh": other.get("status"),
                    "reserved_fresh": other.get("reserved"),
                    "fresh_from": other.get("from"),
                })  # fmt: skip
        rows.append(row)
    return rows


def replay_guess(config: Dict[str, Any], prompt: int, new: int, logits_batch: Optional[int]) -> Dict[str, int]:
    """The memory model's largest batch on the budget's GPU: by allocated bytes, and held to the replay of the
    calls the measured jobs made (`logits_batch`: their logits call's sequences, None: the point's batch)."""
    from dsexp.engines.placement import RULES
    from dsexp.predict.job import Facts, largest_batch, outside, predict, replayed

    pred = predict(config, RULES, Facts(device="cuda"))
    gpu = int(config["budget"]["gpu_gib"] * GIB)
    held = sum(outside(config, pred.strategy, pred.tp, RULES).values())
    allocated = largest_batch(pred, prompt, new, gpu, held).largest_batch
    answer = replayed(pred, config, RULES, prompt, new, gpu - held, {"largest_batch": allocated}, logits_batch)
    which = "expandable_segments" if pred.strategy.expandable_segments else "default"
    return {"allocated": allocated, "replay": answer[which]["batch"]}


def one_load_search(entry: Dict[str, Any], batches: List[int], device: int, guess: int, largest_ok: int):
    """The search as dsexp runs it now on a GPU (its answer confirmed as a fresh load's first point where it ran
    after another with less than budget.confirm_margin_gib under the budget, at the peak the committed search
    measured at that batch), against the measured bracket taken as what a load's first point meets: (loads, the
    batches each load ran)."""
    from dsexp.compose.budget import search as S
    from dsexp.core.bisect import OK, OOM, next_batch

    index = max((i for i, b in enumerate(batches) if b <= guess), default=-1)
    c = S.Config(entry["key"], dict(entry.get("dims") or {}), entry["needs"], entry.get("tp", 1), one_load=True,
                 replayed=index, confirm_margin=int(0.5 * GIB))  # fmt: skip
    state = S.State(device, batches, [c])
    peaks = {p["batch"]: p.get("peak") for p in entry.get("points") or [] if p.get("status") == OK}
    loads = []
    while True:
        todo = S.next_round(state)
        if not todo:
            return loads
        (_, job), outcomes, ran = todo[0], {}, []
        batch = job.start
        while batch is not None:
            outcomes[batch] = OK if batch <= largest_ok else OOM
            c.points.append(S.Point(batch, outcomes[batch], peaks.get(batch) if batch <= largest_ok else None,
                                    job=str(len(loads)), first=not ran))  # fmt: skip
            ran.append(batch)
            batch = next_batch(job.batches, job.start, outcomes)
        loads.append(ran)


def configuration_rows(search: str) -> List[Dict[str, Any]]:
    state = json.loads((BUDGET / search / "budget.json").read_text())
    rows = []
    for entry in state["configs"]:
        if entry.get("largest_ok") is None or entry.get("smallest_oom") is None:
            continue
        jobs = {p["job"] for p in entry["points"]}
        results = search_jobs(search, entry)
        if not results:
            continue
        timed = [point_seconds(r) for r in results]
        fixed = [r["wall_s"] - sum(t.values()) for r, t in zip(results, timed)]
        by_batch = {b: s for t in timed for b, s in t.items()}
        mean_point = statistics.mean(by_batch.values())
        guess = replay_guess(results[0]["config"], state["prompt_tokens"], state["new_tokens"],
                             JobRecord(results[0]).logits_batch)  # fmt: skip
        loads = one_load_search(entry, state["batches"], state["budget"]["device"], guess["replay"],
                                entry["largest_ok"])  # fmt: skip
        points = [b for ran in loads for b in ran]
        rows.append(
            {
                "search": search,
                "config": entry["key"],
                "tp": entry.get("tp"),
                "gpu_gib": state["budget"]["gpu_gib"],
                "bracket": [entry["largest_ok"], entry["smallest_oom"]],
                "allocated_says": guess["allocated"],
                "replay_says": guess["replay"],
                "committed": {
                    "loads": len(jobs),
                    "points": len(entry["points"]),
                    "wall_s": round(sum(r["wall_s"] for r in results), 1),
                    "jobs_read": len(results),
                },
                "one_load": {
                    "loads": len(loads),
                    "points": len(points),
                    "batches": loads,
                    "wall_s_estimated": round(
                        len(loads) * statistics.mean(fixed) + sum(by_batch.get(b, mean_point) for b in points), 1
                    ),
                },
            }
        )
    return rows


def render(rows: List[Dict[str, Any]], seconds: float) -> str:
    body = [
        [
            f"{r['search']}: `{r['config']}`",
            f"{r['bracket'][0]} / {r['bracket'][1]}",
            r["allocated_says"],
            r["replay_says"],
            f"{r['committed']['loads']} / {r['committed']['points']} / {r['committed']['wall_s']:.0f}",
            f"{r['one_load']['loads']} / {r['one_load']['points']} / {r['one_load']['wall_s_estimated']:.0f}",
            " then ".join(",".join(map(str, ran)) for ran in r["one_load"]["batches"]),
        ]
        for r in rows
    ]
    total = {k: sum(r["committed"][k] for r in rows) for k in ("loads", "points", "wall_s")}
    new = {k: sum(r["one_load"][k] for r in rows) for k in ("loads", "points", "wall_s_estimated")}
    held = sum(1 for r in rows if r["one_load"]["points"] <= 3 and r["one_load"]["loads"] == 1)
    return "\n".join(
        [
            "# The budget search's cost: one load per configuration against a load per guess",
            "",
            f"Generated by `benchmarks/search_cost.py` in {seconds:.0f} s on this machine (no GPU): the committed H200 "
            "searches' brackets and measured times; the one-load column is ESTIMATED from them (module docstring).",
            "",
            *table(
                [
                    "configuration",
                    "measured last ok / first OOM",
                    "allocated bytes say",
                    "replay says",
                    "committed: loads / points / wall s",
                    "one load: loads / points / est. wall s",
                    "one load: batches run",
                ],
                body,
            ),  # fmt: skip
            f"Over {len(rows)} configurations: committed {total['loads']} loads, {total['points']} points, "
            f"{total['wall_s']:.0f} s of jobs; one load {new['loads']} loads, {new['points']} points, "
            f"{new['wall_s_estimated']:.0f} s estimated. {held} of {len(rows)} settle in one load of at most 3 "
            "points (the guess, one above, one below only if the guess ran out of memory).",
            "",
        ]
    )


def gib(n: Optional[int]) -> str:
    return "-" if n is None else f"{n / GIB:.2f}"


def bracket_text(b: List[Optional[int]]) -> str:
    return " / ".join("-" if x is None else str(x) for x in b)


def render_measured(rows: List[Dict[str, Any]]) -> str:
    """The one-load searches the GPU ran, beside the committed ones (measured against measured)."""
    head = ["## Measured: the one-load searches", "", "<!-- section: measured -->", ""]
    if not rows:
        why = f"Not measured yet: no {' or '.join(ONE_LOAD)} folder under results/h200/budget (campaign `budget`)."
        return "\n".join(head + [why, ""])
    body, pairs = [], []
    for r in rows:
        c = r["committed"] or {}
        body.append([
            f"{r['search']}: `{r['config']}`",
            r["gpu"],
            "-" if r["guess"] is None else r["guess"],
            bracket_text(r["bracket"]),
            f"{r['loads']} / {r['points']} / {r['wall_s']:.0f}",
            bracket_text(c.get("bracket") or [None, None]),
            "yes" if r["same_answer"] else "no" if c else "(no committed search)",
            f"{c['loads']} / {c['points']} / {c['wall_s']:.0f}" if c else "-",
        ])  # fmt: skip
        for a in r["in_load"]:
            mine, fresh = a["reserved_in_process"], a["reserved_fresh"]
            diff = "-" if None in (mine, fresh) else f"{(mine - fresh) / 2**20:+.0f}"
            pairs.append([
                f"{r['search']}: `{r['config']}`", a["batch"], a["after"], "yes" if a["cache_emptied"] else "no",
                a["status"], a["status_fresh"] or "-", gib(mine), gib(fresh), diff, a["fresh_from"] or "-",
            ])  # fmt: skip
    held = [r for r in rows if r["committed"]]
    within = sum(r["points"] <= 3 for r in rows)
    out = head + table(["configuration", "GPU", "first guess", "one load: last ok / first OOM",
                        "one load: loads / points / wall s", "committed: last ok / first OOM", "same answer",
                        "committed: loads / points / wall s"], body)  # fmt: skip
    out += [
        f"{sum(r['same_answer'] for r in held)} of the {len(held)} configurations with a committed search found its "
        f"answer; {within} of {len(rows)} settled in at most 3 points.",
        "",
        "A point run after another of the same job, against a fresh process that ran the same batch first (status; "
        "GiB reserved at the point's peak, the highest rank):",
        "",
    ]
    if pairs:
        heads = ["configuration", "batch", "after", "cache emptied", "status", "fresh: status",
                 "reserved in the same load", "fresh: reserved", "difference MiB", "fresh: in"]  # fmt: skip
        out += table(heads, pairs)
    else:
        out += ["None: no job ran a point after another of its own.", ""]
    return "\n".join(out + [""])


def main() -> int:
    t0 = time.perf_counter()
    rows = [row for search in SEARCHES for row in configuration_rows(search)]
    measured = [row for one_load, committed in ONE_LOAD.items() for row in measured_rows(one_load, committed)]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.with_suffix(".json").write_text(json.dumps({"estimated": rows, "measured": measured}, indent=1))
    text = render(rows, time.perf_counter() - t0) + "\n" + render_measured(measured)
    OUT.with_suffix(".md").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
