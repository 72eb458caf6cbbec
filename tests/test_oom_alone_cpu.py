"""A rank that runs out of memory alone inside a grid point's forward (tp=2 on the CPU, fault kind=oom_forward on rank
1: its peer waits in the next layer's all_reduce) must not hang the job: the OOM is recorded with the rank, the
point and the allocator's state, the launch ends within launcher.grace_s, the peer's record says why it ended, the
grid's points left are run by one more launch, and the sweep's next job (every rank out of memory at the same point:
they agree and go on) runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsexp.job import teardown

from helpers.run import run_dsexp, sweep_results

KEY = "generate[b=4,l=8]"  # 32 tokens: the first point at or past at_tokens
TIMEOUT_S, GRACE_S = 300, 10
pytestmark = pytest.mark.timeout(1200)
SLOW = pytest.mark.slow  # the sweep: two jobs, one launched twice (70-110 s here); the single job: 63-77 s here


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, cache_dir):
    return run_grid(tmp_path_factory, cache_dir, "{rank:1,at_tokens:32},{rank:all,at_tokens:32}", "[8,12]")


def run_grid(tmp_path_factory, cache_dir, faults: str, lengths: str, grace_s: float = GRACE_S):
    """A multirun of tp=2 jobs over the grid batch [1, 4] x `lengths`, one per fault (kind oom_forward)."""
    cwd = tmp_path_factory.mktemp("oom")
    run_dsexp(
        [
            "-m",
            "tp=2",
            "debug=fault",
            "fault=" + faults.replace("{", "{kind:oom_forward,"),
            "check.correctness=false",
            "probe.sample_ms=0",
            "probe.see_memory_usage=false",
            "generate.batch_size=[1,4]",
            f"generate.prompt_tokens={lengths}",
            "generate.new_tokens=3",
            "generate.repeats=1",
            "generate.warmup=0",
            f"timeout_s={TIMEOUT_S}",
            f"launcher.grace_s={grace_s}",
            "hydra.sweep.dir=multirun/oom",
        ],
        cwd,
        cache_dir,
    )
    return sweep_results(cwd / "multirun" / "oom")


def statuses(rank):
    return [(p["batch"], p["prompt_tokens"], p["status"]) for p in rank["points"]]


GRID = [(1, 8, "ok"), (4, 8, "oom"), (1, 12, "ok"), (4, 12, "skipped")]  # (4, 12) is larger than (4, 8)


def check_ended_within_grace(launch, rank1, grace_s=GRACE_S):
    """The launch ended by itself, soon after rank 1 ran out at KEY, which it recorded with the allocator's state."""
    oom_at = rank1["clock"]["t0"] + next(e["t1"] for e in rank1["timeline"] if e["phase"] == KEY)
    assert launch["clock"]["exited"] - oom_at < grace_s + 5  # not the job's timeout_s: nobody hung
    assert launch["returncode"] is not None  # the launch ended by itself, not at timeout_s
    point = rank1["phases"][KEY]["point"]
    assert point["out_of_memory"]["type"] == "OutOfMemoryError" and point["out_of_memory"]["allocator"]["host_rss"] > 0


@SLOW
def test_a_rank_alone_out_of_memory_at_the_last_point_ends_the_job_within_grace(tmp_path_factory, cache_dir):
    (res,) = run_grid(tmp_path_factory, cache_dir, "{rank:1,at_tokens:32}", "[8]", grace_s=4)  # (4, 8): the last
    assert res["status"] == "ok", res.get("failure")
    assert "launches" not in res  # nothing left to relaunch for
    rank0, rank1 = res["ranks"]
    check_ended_within_grace(res["launch"], rank1, grace_s=4)
    assert rank1["ended"]["how"] == "oom" and rank1["ended"]["oom_ranks"] == [1]
    assert (
        rank0["ended"]["how"] == "torn_down" and rank0["ended"]["after_rank"] == 1 and KEY in rank0["ended"]["message"]
    )
    assert statuses(rank0) == statuses(rank1) == [(1, 8, "ok"), (4, 8, "oom")]
    assert teardown.job_processes(res["teardown"]["token"]) == []


@SLOW
def test_the_launch_ends_within_grace_after_the_rank_ran_out_alone(sweep):
    alone = sweep[0]
    (first,) = alone["launches"]
    assert first["ended"]["rank"] == 1 and first["ended"]["phase"] == KEY and first["ended"]["oom_ranks"] == [1]
    check_ended_within_grace(first, json.loads(Path(first["dir"], "ranks", "rank1.json").read_text()))


@SLOW
def test_the_peer_says_it_was_torn_down_after_the_rank_ran_out(sweep):
    first = sweep[0]["launches"][0]
    rank0 = json.loads(Path(first["dir"], "ranks", "rank0.json").read_text())
    ended = rank0["ended"]
    assert ended["how"] == "torn_down" and ended["after_rank"] == 1 and KEY in ended["message"]
    assert first["ranks"]["rank0"] == rank0["ended"]
    assert sweep[0]["ranks"][0]["earlier_launches"][0]["ended"]["how"] == "torn_down"


@SLOW
def test_the_points_left_run_in_one_more_launch_and_the_grid_completes(sweep):
    alone = sweep[0]
    assert alone["status"] == "ok", alone.get("failure")
    assert alone["launches"][0]["relaunched_for"] == [{"batch": 1, "prompt_tokens": 12}]
    for rank in alone["ranks"]:
        assert statuses(rank) == GRID
        assert [e["phase"] for e in rank["timeline"] if e["kind"] == "generate"] == ["generate[b=1,l=12]"]
        assert "generate_b1_l12.ttft_p50_s.max" in alone["metrics"] or rank["phases"]["generate[b=1,l=12]"]["point"]
    assert alone["ranks"][0]["points"][1]["torn_down"] and alone["ranks"][1]["points"][1]["oom_ranks"] == [1]


@SLOW
def test_the_next_job_runs_and_ranks_out_of_memory_together_go_on(sweep):
    together = sweep[1]
    assert together["status"] == "ok", together.get("failure")
    assert "launches" not in together
    for rank in together["ranks"]:
        assert statuses(rank) == GRID
        assert rank["points"][1]["oom_ranks"] == [0, 1] and "ended" not in rank


@SLOW
def test_no_process_is_left(sweep):
    for res in sweep:
        assert teardown.job_processes(res["teardown"]["token"]) == []


@SLOW
def test_the_trace_holds_every_launch_so_the_point_that_ran_out_stays_visible(sweep):
    alone = sweep[0]
    trace = json.loads((Path(alone["job_dir"]) / alone["trace"]).read_text())
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert sorted(names.values()) == [f"rank {r} (launch {n} of 2)" for r in (0, 1) for n in (1, 2)]
    first_rank1 = next(pid for pid, n in names.items() if n == "rank 1 (launch 1 of 2)")
    slices = [e["name"] for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == first_rank1]
    assert KEY in slices  # the point rank 1 ran out at, in the launch it ended
