"""Each point of a load starts from the allocator's state the load left (dsexp.rank.workloads.pipeline): the cache an
earlier point left is emptied first, the state it starts with recorded, and a point that could not start as a fresh
process would is not the budget search's (dsexp.compose.budget.points): its batch stays open for a fresh load."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from dsexp.compose.budget import points as P
from dsexp.core.schema import JobConfig
from dsexp.rank.workloads import pipeline

MIB = 2**20
WEIGHTS = 19_878 * MIB


def state(allocated: int, reserved: int, segments: int) -> dict:
    return {"allocated": allocated, "reserved": reserved, "segments": segments}


def test_a_point_starts_as_the_load_left_it_unless_a_block_pins_a_segments_free_bytes():
    first = state(WEIGHTS, WEIGHTS + 8 * MIB, 40)
    # cuBLAS's 32 MiB workspace, made in the first point, in a segment of its own: as many bytes reserved as held
    own_segment = state(WEIGHTS + 32 * MIB, WEIGHTS + 40 * MIB, 41)
    # the same workspace carved from a 2 GiB block of the first point's: that segment stays, its free bytes cached
    pinned = state(WEIGHTS + 32 * MIB, WEIGHTS + 8 * MIB + 2048 * MIB, 41)
    # a few small blocks left in a small-pool segment: within one such segment of the load's state
    small = state(WEIGHTS + 1024, WEIGHTS + 8 * MIB + 2 * MIB, 41)
    assert pipeline.as_load(first, first)
    assert pipeline.as_load(own_segment, first)
    assert not pipeline.as_load(pinned, first)
    assert pipeline.as_load(small, first)
    assert not pipeline.as_load(state(WEIGHTS, WEIGHTS + 11 * MIB, 40), first)  # 3 MiB more cached: not the same


def run_generate(monkeypatch, tmp_path, starts, statuses=("ok", "ok", "ok"), batches=(2, 3, 4), lengths=64):
    """generate() over a grid (three batches by default) on a stand-in GPU: the allocator's start states given,
    each point 'ran' with its status; (the order of releases and points, the points' entries)."""
    events, states, status = [], iter(starts), iter(statuses)
    spec = JobConfig()
    spec.generate.batch_size, spec.generate.prompt_tokens = list(batches), lengths
    ctx = SimpleNamespace(spec=spec, rank=1, world_size=2, on_gpu=True, runtime={}, job_dir=tmp_path)
    noted = {}
    rec = SimpleNamespace(note=lambda **kw: noted.update(kw))
    module = SimpleNamespace(config=SimpleNamespace(vocab_size=100))

    def fake_point(ctx, rec, module, point, key, text, extra, first=True):
        events.append(("point", point.batch))
        return {**point.to_dict(), "phase": key, "status": next(status)}, None, []

    monkeypatch.setattr("dsexp.rank.generation.prompt_ids", lambda ctx, vocab: [1, 2, 3])
    monkeypatch.setattr(pipeline, "run_point", fake_point)
    monkeypatch.setattr(pipeline, "note_nonfinite", lambda *a, **k: None)
    monkeypatch.setattr(pipeline, "release_memory", lambda on_gpu: events.append(("release", on_gpu)))
    monkeypatch.setattr(pipeline, "allocator_start", lambda on_gpu: next(states))
    pipeline.generate(ctx, rec, module, None, {})
    return events, noted["points"]


def test_every_point_after_the_first_starts_from_an_emptied_cache_and_says_whether_it_started_as_the_load_left_it(
    monkeypatch, tmp_path
):
    first = state(WEIGHTS, WEIGHTS + 8 * MIB, 40)
    starts = [
        first,
        state(WEIGHTS + 32 * MIB, WEIGHTS + 40 * MIB, 41),
        state(WEIGHTS + 32 * MIB, WEIGHTS + 2 * 2**30, 41),
    ]
    events, outcomes = run_generate(monkeypatch, tmp_path, starts)
    assert events == [("point", 2), ("release", True), ("point", 3), ("release", True), ("point", 4)]
    assert [o["start"]["as_load"] for o in outcomes] == [True, True, False]
    assert outcomes[1]["start"]["reserved"] == WEIGHTS + 40 * MIB


def test_a_point_after_one_that_ran_out_of_memory_is_not_released_twice(monkeypatch, tmp_path):
    # run_point released the memory of the point that ran out (the stand-in here does not): the next starts at once
    starts = [state(WEIGHTS, WEIGHTS + 8 * MIB, 40)] * 3
    statuses = ("ok", "oom", "ok")  # (2, 32), (3, 32) runs out, (2, 64); (3, 64) is skipped as larger
    events, outcomes = run_generate(monkeypatch, tmp_path, starts, statuses, batches=(2, 3), lengths=[32, 64])
    assert events == [("point", 2), ("release", True), ("point", 3), ("point", 2)]
    assert [o["status"] for o in outcomes] == ["ok", "oom", "ok", "skipped"]
    assert pipeline.last_ran([*outcomes, {"batch": 5, "status": "skipped"}]) == "ok"
    assert pipeline.last_ran([]) is None


def entry(batch, status, as_load):
    start = state(WEIGHTS, WEIGHTS + (8 if as_load else 2056) * MIB, 40)
    return {
        "batch": batch,
        "phase": f"generate[b={batch},l=64]",
        "status": status,
        "start": {**start, "as_load": as_load},
    }


def searched_result():
    """A one-load job of two ranks: 9 ran, 10 ran (rank 1 started it with a segment batch 9 left), 11 ran out."""
    sim = {"budget": {"simulated_need": 700, "fits": True}}
    return {
        "status": "ok",
        "job_dir": "j",
        "config": {"generate": {"batch_size": [9, 10, 11, 12], "bisect_from": 9}},
        "ranks": [
            {
                "rank": r,
                "points": [entry(9, "ok", True), entry(10, "ok", r == 0), entry(11, "oom", True)],
                "phases": {f"generate[b={b},l=64]": sim for b in (9, 10)},
            }
            for r in (0, 1)
        ],
    }


def test_a_point_that_did_not_start_as_the_load_left_it_leaves_its_batch_open_for_a_fresh_load():
    pts, stop = P.points_of(Path("j"), searched_result())
    # batch 10 started on rank 1 with a segment the first point left: not counted, so 9 / 11 stays open at 10
    assert [(p.batch, p.status) for p in pts] == [(9, "ok"), (11, "oom")] and stop is None
    assert P.not_as_load(searched_result()) == {10: 2056 * MIB}


def test_the_search_says_which_batch_it_did_not_count_and_lists_it_with_its_job(capsys):
    from dsexp.compose.budget import search as S
    from dsexp.compose.budget.sweeper import BudgetSearch

    result = searched_result()
    bs = object.__new__(BudgetSearch)  # the search's state alone: no sweeper, no launcher
    bs.identity, bs.jobs = {"tp=2": P.identity(result["config"])}, []
    bs.state = S.State(40 * 2**30, [9, 10, 11, 12], [S.Config("tp=2", {}, [0] * 4, 2, one_load=True)])
    bs.absorb(Path("j"), result)
    (c,) = bs.state.configs
    assert [p.batch for p in c.points] == [9, 11] and bs.jobs[0]["not_counted"] == [10]
    assert "tp=2: batch 10 of job j started with 2056 MiB in cached blocks" in capsys.readouterr().out


def test_an_answer_run_after_another_point_says_how_it_started_and_what_a_fresh_first_call_may_add():
    from dsexp.analysis import budget_runs as B
    from dsexp.analysis.sections.budget_answer import _in_load

    result = searched_result()
    assert (B.ran_before(result, 9), B.ran_before(result, 10)) == (None, 9)
    assert (B.started_as_load(result, 9), B.started_as_load(result, 10)) == (True, False)  # rank 1 did not
    del result["ranks"][1]["points"][0]["start"]
    assert B.started_as_load(result, 9) is None  # not recorded on every rank
    answer = B.Candidate("tp=2", 2, 10, None, None, [1], None, "0", after=9, as_load=True)
    (line,) = _in_load(answer)
    assert line.startswith("Batch 10 ran after batch 9 in the same load, from the allocator's state the load left")
    assert _in_load(B.Candidate("tp=2", 2, 9, None, None, [1], None, "0")) == []


def test_the_batch_left_open_is_the_next_loads_first_point_a_fresh_process():
    """After 9 ran and 11 ran out of memory (10 not counted), the configuration's next job searches batch 10 alone,
    from 10: its load's first point, as a fresh process runs it."""
    from dsexp.compose.budget import search as S

    result = searched_result()
    needs = [30 * 2**30] * 4  # the model says every batch fits: the open batch decides
    c = S.Config("tp=2", {}, needs, 2, one_load=True)
    c.points, _ = P.points_of(Path("j"), result)
    job = S.next_job(c, S.State(40 * 2**30, [9, 10, 11, 12], [c]))
    assert (job.batches, job.start) == ([10], 10)


def test_a_rank_whose_peer_ran_out_before_the_forward_releases_its_cache_too(monkeypatch, tmp_path):
    # the point ends as out of memory on every rank; this one raised nothing, yet the next point starts without a
    # release of its own (last_ran), so run_point releases here as it does where the rank ran out itself
    events = []
    spec = JobConfig()
    ctx = SimpleNamespace(spec=spec, rank=1, world_size=2, on_gpu=True, runtime={}, job_dir=tmp_path, device="cuda:0")
    rec = SimpleNamespace(
        record={"phases": {}},
        begin=lambda key: key,
        end=lambda key, error=None: events.append(("end", key)),
        annotate_phase=lambda key, **kw: None,
        note=lambda **kw: None,
    )
    monkeypatch.setattr(pipeline, "simulate_point", lambda ctx, weights, point: None)
    monkeypatch.setattr(pipeline, "ranks_out_before_forward", lambda world, rank, mine, device: [0])
    monkeypatch.setattr(pipeline, "release_memory", lambda on_gpu: events.append(("release", on_gpu)))
    monkeypatch.setattr(pipeline, "forward", lambda *a, **k: pytest.fail("no forward after a peer ran out"))
    entry, logits, tokens = pipeline.run_point(ctx, rec, None, pipeline.Point(9, 64), "generate[b=9,l=64]", [], {})
    assert entry["status"] == "oom" and entry["oom_ranks"] == [0]
    assert events == [("end", "generate[b=9,l=64]"), ("release", True)]
