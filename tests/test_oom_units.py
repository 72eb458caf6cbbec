"""A point that runs out of memory at tp>1, in parts: the ranks that ran out agree through a store whether they go on
(dsexp.rank.oom_agreement), and the job marks how each rank ended, finds the points left and merges the launches
(dsexp.job.oom_relaunch). The end-to-end run is tests/test_oom_alone_cpu.py."""

from __future__ import annotations

import json
import threading
import time

from dsexp.core.workload import Point
from dsexp.job import oom_relaunch as job_oom
from dsexp.rank.oom_agreement import agree_after_forward

GRID = {"batch_size": [1, 4], "prompt_tokens": [8, 12]}  # runs (1,8) (4,8) (1,12) (4,12)
KEY = "generate[b=4,l=8]"


def agree_all(store, counts, wait_s=5.0):
    """Every rank of len(counts) agreeing at once (threads), rank r with counts[r]: {rank: its answer}."""
    out = {}

    def one(r):
        out[r] = agree_after_forward(r, len(counts), KEY, wait_s, store=store, counts=counts[r])

    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(counts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_ranks_out_of_memory_at_the_same_point_with_the_same_collectives_go_on():
    from torch.distributed import HashStore

    got = agree_all(HashStore(), [{"0": 7}, {"0": 7}])
    assert got == {0: (True, [0, 1]), 1: (True, [0, 1])}


def test_ranks_whose_collectives_differ_end():
    from torch.distributed import HashStore

    got = agree_all(HashStore(), [{"0": 7}, {"0": 8}])  # one left a collective behind (NCCL returns before peers)
    assert got == {0: (False, [0, 1]), 1: (False, [0, 1])}


def test_ranks_whose_collectives_torch_cannot_count_end(monkeypatch):
    from torch.distributed import HashStore

    monkeypatch.setattr("dsexp.rank.oom_agreement.collective_counts", lambda: None)
    got = agree_all(HashStore(), [None, None])  # counts=None: the rank reads its own, here unknown
    assert got == {0: (False, [0, 1]), 1: (False, [0, 1])}


def test_a_rank_out_of_memory_alone_ends_after_the_wait_and_a_late_one_follows_that_verdict():
    from torch.distributed import HashStore

    store = HashStore()
    t0 = time.perf_counter()
    assert agree_after_forward(1, 2, KEY, 0.5, store=store, counts={"0": 3}) == (False, [1])
    assert 0.4 < time.perf_counter() - t0 < 5
    # rank 0 runs out later, finds both posts, but the verdict is already taken: it ends too
    assert agree_after_forward(0, 2, KEY, 0.5, store=store, counts={"0": 3}) == (False, [0, 1])


def test_at_tp1_an_out_of_memory_point_goes_on():
    assert agree_after_forward(0, 1, KEY, 0.1) == (True, [0])


def launch_one(tmp_path):
    """The records of a launch where rank 1 ran out alone at (4, 8) and rank 0 was stopped in that point."""
    ended = {"how": "oom", "rank": 1, "phase": KEY, "point": {"batch": 4, "prompt_tokens": 8}, "oom_ranks": [1]}
    ok = {"batch": 1, "prompt_tokens": 8, "phase": "generate[b=1,l=8]", "status": "ok"}
    rank0 = {"rank": 0, "status": "running", "error": None, "points": [ok], "phases": {KEY: {"partial": True}}}
    rank1 = {
        "rank": 1,
        "status": "ok",
        "error": None,
        "ended": ended,
        "points": [ok, {"batch": 4, "prompt_tokens": 8, "phase": KEY, "status": "oom", "oom_ranks": [1]}],
        "phases": {"generate[b=1,l=8]": {"point": {"latency": 1}}, KEY: {}},
    }
    (tmp_path / "ranks").mkdir()
    return [rank0, rank1]


def test_the_peer_says_it_was_torn_down_and_the_points_left_are_the_undominated_ones(tmp_path):
    ranks = launch_one(tmp_path)
    ended = job_oom.ended_by_oom(ranks)
    assert ended["rank"] == 1
    job_oom.mark_torn_down(tmp_path, ranks, ended)
    peer = ranks[0]
    assert peer["status"] == "ok" and peer["ended"]["how"] == "torn_down" and peer["ended"]["after_rank"] == 1
    assert "after rank 1 ran out of memory" in peer["ended"]["message"] and KEY in peer["ended"]["message"]
    assert peer["points"][-1] == {**ended["point"], "phase": KEY, "status": "oom", "oom_ranks": [1], "torn_down": True}
    assert json.loads((tmp_path / "ranks" / "rank0.json").read_text())["ended"] == peer["ended"]  # on disk too
    assert job_oom.points_left(GRID, [ranks]) == [Point(1, 12)]  # (4, 12) is larger than (4, 8)


def test_an_error_of_its_own_elsewhere_is_not_the_teardowns(tmp_path):
    ranks = launch_one(tmp_path)
    ranks[0]["error"] = {"phase": "init", "type": "ValueError", "message": "bad"}
    job_oom.mark_torn_down(tmp_path, ranks, job_oom.ended_by_oom(ranks))
    assert "ended" not in ranks[0] and ranks[0]["error"]["type"] == "ValueError"


def test_a_peer_that_only_saw_its_peer_go_away_was_torn_down(tmp_path):
    ranks = launch_one(tmp_path)
    ranks[0]["error"] = {"phase": KEY, "type": "RuntimeError", "message": "Connection closed by peer"}
    job_oom.mark_torn_down(tmp_path, ranks, job_oom.ended_by_oom(ranks))
    assert ranks[0]["error"] is None and ranks[0]["ended"]["error"]["message"] == "Connection closed by peer"


def test_the_relaunch_records_carry_every_launchs_points_in_grid_order(tmp_path):
    first = launch_one(tmp_path)
    job_oom.mark_torn_down(tmp_path, first, job_oom.ended_by_oom(first))
    entry = {"batch": 1, "prompt_tokens": 12, "phase": "generate[b=1,l=12]", "status": "ok"}
    second = [
        {"rank": r, "status": "ok", "error": None, "points": [entry], "phases": {entry["phase"]: {}}} for r in (0, 1)
    ]
    merged = job_oom.merge_launches([first], second, GRID)
    for rec in merged:
        assert [(p["batch"], p["prompt_tokens"], p["status"]) for p in rec["points"]] == [
            (1, 8, "ok"),
            (4, 8, "oom"),
            (1, 12, "ok"),
            (4, 12, "skipped"),
        ]
        assert rec["earlier_launches"][0]["ended"]["how"] == ("torn_down" if rec["rank"] == 0 else "oom")
    assert "generate[b=1,l=8]" in merged[1]["phases"] and "generate[b=1,l=12]" in merged[1]["phases"]


def test_a_point_no_launch_reached_is_listed_as_not_run():
    points = [{"batch": 1, "prompt_tokens": 8, "phase": "generate[b=1,l=8]", "status": "ok"}]
    out = job_oom.complete_points(points, GRID)
    assert [p["status"] for p in out] == ["ok", "not_run", "not_run", "not_run"] and out[1]["why"]


def test_a_point_not_run_is_no_measurement_for_the_budget_search():
    from dsexp.analysis.budget_runs import point_phase

    points = [
        {"batch": 1, "prompt_tokens": 8, "phase": "generate[b=1,l=8]", "status": "ok"},
        {"batch": 4, "prompt_tokens": 8, "phase": "generate[b=4,l=8]", "status": "not_run"},
    ]
    result = {"ranks": [{"rank": 0, "status": "ok", "points": points, "phases": {}}]}
    assert point_phase(result, 1) == "generate[b=1,l=8]" and point_phase(result, 4) is None


def test_a_relaunch_gets_what_the_jobs_time_limit_has_left(tmp_path, monkeypatch):
    """timeout_s is the job's: the first launch (rank 1 out of memory alone at (4, 8)) takes 70 of its 100 s, so the
    relaunch for (1, 12) is given the 30 s left, not another 100."""
    from types import SimpleNamespace

    from dsexp.job import run as R

    from helpers.run import spec_of

    spec = spec_of("generate.batch_size=[1,4]", "generate.prompt_tokens=[8,12]", "timeout_s=100", "tp=2")
    clock = {"now": 1000.0}
    given = []
    entry = {"batch": 1, "prompt_tokens": 12, "phase": "generate[b=1,l=12]", "status": "ok"}
    launches = [launch_one(tmp_path), [{"rank": r, "status": "ok", "error": None, "points": [entry],
                                        "phases": {entry["phase"]: {}}} for r in (0, 1)]]  # fmt: skip

    def fake_run_ranks(spec, job_dir, device, visible, stack, script, timeout_s):
        given.append(timeout_s)
        clock["now"] += 70.0
        (job_dir / "ranks").mkdir(exist_ok=True)
        return SimpleNamespace(timed_out=False, returncode=0, to_dict=lambda: {"returncode": 0})

    monkeypatch.setattr(R.time, "monotonic", lambda: clock["now"])
    monkeypatch.setattr(R, "run_ranks", fake_run_ranks)
    monkeypatch.setattr(R.records, "read_rank_records", lambda job_dir, tp: launches[len(given) - 1])
    _, ranks, earlier = R.launch_for_points(spec, tmp_path, {"stack": None}, None)
    assert given == [100.0, 30.0] and len(earlier) == 1
    assert [p["status"] for p in ranks[0]["points"]] == ["ok", "oom", "ok", "skipped"]
