"""trace.json of real tiny CPU jobs (the session's sweep, tp=1 and tp=2): one track per rank, one slice per recorded
phase with the record's keys and times, and memory counters whose maximum within each phase is the peak the rank
recorded for it."""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest

from helpers.run import sweep_results

US = 1e6


@pytest.fixture(scope="module")
def jobs(tiny_sweep):
    _, sweep_dir, _ = tiny_sweep
    results = sweep_results(sweep_dir)
    assert [r["config"]["tp"] for r in results] == [1, 2] and all(r["status"] == "ok" for r in results)
    return [(res, json.loads((Path(res["job_dir"]) / res["trace"]).read_text())) for res in results]


def tracks(trace):
    """{rank: pid} from the process_name metadata, and the events by pid."""
    names = {
        e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["ph"] == "M" and e["name"] == "process_name"
    }
    by_pid = defaultdict(list)
    for e in trace["traceEvents"]:
        by_pid[e["pid"]].append(e)
    return {int(n.removeprefix("rank ")): pid for pid, n in names.items()}, by_pid


def test_one_track_per_rank(jobs):
    for res, trace in jobs:
        ranks, _ = tracks(trace)
        assert sorted(ranks) == list(range(res["config"]["tp"]))
        assert len(set(ranks.values())) == len(ranks)
        assert trace["distributedInfo"]["world_size"] == res["config"]["tp"]


def test_one_slice_per_recorded_phase_with_its_key_and_times(jobs):
    for res, trace in jobs:
        ranks, by_pid = tracks(trace)
        starts = {}
        for rk in res["ranks"]:
            slices = [e for e in by_pid[ranks[rk["rank"]]] if e["ph"] == "X"]
            assert [s["name"] for s in slices] == [e["phase"] for e in rk["timeline"]]
            assert [s["name"] for s in slices] == ["start", "load", "init", "generate"]
            for s, e in zip(slices, rk["timeline"]):
                assert abs(s["dur"] - (e["t1"] - e["t0"]) * US) <= 1  # microseconds, at the series' resolution
                assert abs((s["ts"] - slices[0]["ts"]) - (e["t0"] - rk["timeline"][0]["t0"]) * US) <= 1
                assert s["args"]["kind"] == e["kind"] and s["args"]["wall_s"] == rk["phases"][e["phase"]]["wall_s"]
            starts[rk["rank"]] = (slices[0]["ts"], rk["clock"]["t0"] + rk["timeline"][0]["t0"])
        # ranks on one time axis: their slices are as far apart as their clocks say
        for r, (ts, epoch) in starts.items():
            assert abs((ts - starts[0][0]) - (epoch - starts[0][1]) * US) <= 2


def test_counters_peak_within_each_phase_at_the_recorded_peak(jobs):
    for res, trace in jobs:
        ranks, by_pid = tracks(trace)
        for rk, series in zip(res["ranks"], res["series"]):
            events = by_pid[ranks[rk["rank"]]]
            counters = [e for e in events if e["ph"] == "C"]
            assert {c["name"] for c in counters} == {"host_rss", "host_anon", "node_used"} == set(series["fields"])
            # a counter for every value read: RSS at every reading, the node's figure at the full ones
            assert len(counters) == sum(v is not None for p in series["points"] for v in p[1:])
            assert sum(p[3] is not None for p in series["points"]) < len(series["points"])
            checked = 0
            for s in (e for e in events if e["ph"] == "X"):
                inside = [c for c in counters if s["ts"] < c["ts"] <= s["ts"] + s["dur"]]
                assert max(c["ts"] for c in inside) == s["ts"] + s["dur"]  # the reading that closed the phase
                for name in ("host_rss", "host_anon", "node_used"):
                    peak = rk["phases"][s["name"]]["peaks"][f"{name}_peak"]
                    assert max(c["args"]["bytes"] for c in inside if c["name"] == name) == peak, (s["name"], name)
                    assert s["args"][f"{name}_peak"] == peak
                    checked += 1
            assert checked == 12


def test_result_json_carries_each_ranks_whole_series(jobs):
    for res, _ in jobs:
        for rk, series in zip(res["ranks"], res["series"]):
            path = Path(res["job_dir"]) / rk["series"]["file"]
            assert series["file"] == rk["series"]["file"] == f"ranks/rank{rk['rank']}.series.jsonl"
            assert series["bytes"] == path.stat().st_size and series["peaks_kept"]
            assert len(series["points"]) == rk["series"]["points"] == len(path.read_text().splitlines()) - 1
            # from the first reading to the last phase's end and beyond, on the rank's own clock
            life = rk["clock"]["finished"] - rk["clock"]["t0"]
            first, last = series["points"][0][0], series["points"][-1][0]
            assert first < round(rk["timeline"][0]["t1"], 6) < round(rk["timeline"][-1]["t1"], 6) < last
            assert series["points"][-1][0] <= life


def test_an_earlier_launch_is_a_process_of_its_own_on_the_same_time_axis():
    """An out-of-memory relaunch (dsexp.job.oom_relaunch) archives the first launch's ranks: the trace draws them
    beside the last launch's, named by launch, their slices where their clocks put them."""
    from dsexp.core.trace import chrome_trace

    def launch(t0, pid, phase):
        rec = {"rank": 0, "pid": pid, "clock": {"t0": t0}, "timeline": [{"phase": phase, "t0": 0.5, "t1": 1.5}]}
        return {"ranks": [{**rec, "phases": {phase: {"wall_s": 1.0}}}]}

    trace = chrome_trace({**launch(110.0, 42, "generate[b=1,l=12]"), "config": {"tp": 1}}, [launch(100.0, 41, "oom")])
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names == {41: "rank 0 (launch 1 of 2)", 42: "rank 0 (launch 2 of 2)"}
    slices = {e["pid"]: (e["name"], e["ts"]) for e in trace["traceEvents"] if e["ph"] == "X"}
    assert slices == {41: ("oom", 500_000), 42: ("generate[b=1,l=12]", 10_500_000)}
    # one launch: named as before
    one = chrome_trace({**launch(110.0, 42, "generate"), "config": {"tp": 1}})
    assert [e["args"]["name"] for e in one["traceEvents"] if e["name"] == "process_name"] == ["rank 0"]
