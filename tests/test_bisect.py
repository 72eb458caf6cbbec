"""The batch search inside one load (dsexp.core.bisect) and the budget search that hands it a configuration's whole
range (dsexp.compose.budget.search with one_load): pure, no ranks."""

from __future__ import annotations

import random

import pytest

from dsexp.compose.budget import search as S
from dsexp.core.bisect import OK, OOM, bracket, next_batch

BATCHES = list(range(1, 65))


def run_search(batches, start, largest):
    """The batches a search from `start` runs on a card whose largest batch that fits is `largest` (0: none)."""
    outcomes, ran = {}, []
    batch = next_batch(batches, start, outcomes)
    while batch is not None:
        assert batch not in outcomes, f"ran {batch} twice: {ran}"
        outcomes[batch] = OK if batch <= largest else OOM
        ran.append(batch)
        batch = next_batch(batches, start, outcomes)
    return ran, outcomes


@pytest.mark.parametrize("largest,ran", [(16, [16, 17]), (17, [16, 17, 18]), (15, [16, 15])])
def test_a_guess_within_one_batch_settles_in_at_most_three_points(largest, ran):
    got, outcomes = run_search(BATCHES, 16, largest)
    assert got == ran
    lo, hi = bracket(BATCHES, outcomes)
    assert BATCHES[lo] == largest and BATCHES[hi] == largest + 1


def test_a_guess_far_off_doubles_its_step_then_bisects():
    ran, outcomes = run_search(BATCHES, 4, 40)
    assert ran[:6] == [4, 5, 6, 8, 12, 20]  # up, the step doubling while only runs are known
    lo, hi = bracket(BATCHES, outcomes)
    assert (BATCHES[lo], BATCHES[hi]) == (40, 41)
    down, outcomes = run_search(BATCHES, 40, 4)
    assert down[:5] == [40, 39, 38, 36, 32]
    assert BATCHES[bracket(BATCHES, outcomes)[0]] == 4


def test_every_boundary_is_found_within_log_steps_from_any_guess():
    for largest in range(0, 65):
        for start in (1, 7, 32, 64):
            ran, outcomes = run_search(BATCHES, start, largest)
            lo, hi = bracket(BATCHES, outcomes)
            assert lo == largest - 1 and hi - lo == 1, (largest, start, ran)
            assert len(ran) <= 2 * 6 + 2, (largest, start, ran)


def test_the_range_ends_settle_it():
    assert run_search(BATCHES, 64, 64)[0] == [64]  # the top ran: nothing above to try
    assert run_search(BATCHES, 1, 0)[0] == [1]  # the bottom ran out of memory: nothing fits
    assert next_batch([], 3, {}) is None
    assert next_batch([5, 6, 7], 1, {}) == 5  # a guess outside the range: its nearest batch


def test_only_outcomes_that_ran_or_ran_out_count():
    assert next_batch([1, 2, 3], 2, {2: "skipped"}) == 2


# --- the budget search over one-load configurations -----------------------------------------------------------


def one_load_state(needs_of, device, configs=("a",), confirm_margin=0):
    return S.State(
        device=device,
        batches=BATCHES,
        configs=[S.Config(k, {"x": k}, needs_of(k), one_load=True, confirm_margin=confirm_margin) for k in configs],
    )


def run_jobs(state, largest_of, fail_at=None, fresh_of=None):
    """Run the search to its end: each job searches inside its load; a job reaching batch `fail_at` fails there
    (a CUDA error other than out of memory) after what it measured; a load's first point fits up to `fresh_of`
    (a process's first generate reserves more), the others up to `largest_of`. Returns [(config, batches run)] per
    job."""
    jobs, failed = [], False
    for _ in range(50):
        todo = S.next_round(state)
        if not todo:
            return jobs
        for c, job in todo:
            assert job.start in job.batches
            outcomes, ran = {}, []
            batch = job.start
            while batch is not None:
                if batch == fail_at and not failed:
                    ran.append(None)
                    failed = True
                    break
                first = not ran
                fits = (fresh_of or largest_of)(c) if first else largest_of(c)
                status = OK if batch <= fits else OOM
                c.points.append(S.Point(batch, status, 0 if status == OK else None, job=str(len(jobs)), first=first))
                outcomes[batch] = status
                ran.append(batch)
                batch = next_batch(job.batches, job.start, outcomes)
            jobs.append((c.key, ran))
    raise AssertionError("the search did not settle")


def test_an_exact_model_settles_a_configuration_in_one_load_of_two_points():
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=160)
    jobs = run_jobs(state, lambda c: 16)
    assert jobs == [("a", [16, 17])]
    c = state.configs[0]
    assert S.loads_used(c) == 1 and S.largest_ok(c, BATCHES) == 16 and S.done(c, state)


def test_the_replay_guess_one_off_costs_one_point_not_a_load():
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=160)
    state.configs[0].replayed = BATCHES.index(14)  # fragmentation: the replay says 14
    jobs = run_jobs(state, lambda c: 13)
    assert jobs == [("a", [14, 13])]


def test_the_floors_first_miss_is_the_top_of_the_range_the_job_searches():
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=160)
    ((c, job),) = S.next_round(state)
    assert job.batches == BATCHES[:17] and job.start == 16  # up to 17, the first the floor says does not fit


def test_a_job_that_failed_after_measuring_goes_on_in_a_fresh_job_from_its_points():
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=160)
    jobs = run_jobs(state, lambda c: 15, fail_at=15)
    # the first load: 16 ran out of memory, then 15 failed otherwise; the second load searches what is still open,
    # below 16, and its guess moved down by the gap 16 showed
    assert jobs == [("a", [16, None]), ("a", [15])]
    assert S.largest_ok(state.configs[0], BATCHES) == 15 and S.loads_used(state.configs[0]) == 2


def test_one_load_searches_settle_whatever_the_model_gets_wrong():
    rng = random.Random(7)
    for trial in range(200):
        truth = rng.randint(0, 64)
        slope = rng.choice([5, 10, 20])
        state = one_load_state(lambda k: [b * slope for b in BATCHES], device=160)
        state.configs[0].replayed = rng.choice([None, rng.randint(0, 63)])
        jobs = run_jobs(state, lambda c: truth)
        c = state.configs[0]
        lo, hi = S.bracket(c, BATCHES)
        assert hi - lo == 1 and (BATCHES[lo] if lo >= 0 else 0) == truth, (trial, jobs)
        assert S.loads_used(c) <= 2, (trial, jobs)  # the floor's first miss ran: the range above it, once


@pytest.mark.parametrize(
    "guess, fresh, jobs",
    [
        (16, 16, [("a", [16, 17])]),  # the guess is the answer, as a first point: nothing to confirm
        (17, 16, [("a", [17, 16]), ("a", [16])]),  # the answer ran after the guess: run again, first, and it fits
        (14, 15, [("a", [14, 15, 16, 18, 17]), ("a", [16]), ("a", [15])]),  # 16 fits later, not first: down one
    ],
)
def test_an_answer_found_after_other_points_of_its_load_is_confirmed_as_a_fresh_loads_first(guess, fresh, jobs):
    """A later point can fit where a fresh process's first generate does not (at 4 x 19 GiB batch 7 ran as a load's
    fourth point and ran out as its first): with a confirm margin larger than the answer's headroom (its points ran at
    a peak of 0 in this simulation) the answer has run first in some load. The model's bytes say up to 20; the
    replay's guess decides where the load starts."""
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=200, confirm_margin=201)
    state.configs[0].replayed = BATCHES.index(guess)
    assert run_jobs(state, lambda c: 16, fresh_of=lambda c: fresh) == jobs
    c = state.configs[0]
    assert S.largest_ok(c, BATCHES) == fresh and S.done(c, state) and S.fresh_answer(c, state)
    assert any(p.first and p.batch == fresh and p.status == OK for p in c.points)


def test_a_confirmation_is_recorded_beside_the_later_point_and_a_first_out_of_memory_decides():
    """The confirming job's point has the batch of one already measured (on an H100 at 4 x 19 GiB, 0ae439c dropped it
    as known and the search stopped with no answer): it is new as the batch's first point, and once only."""
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=200, confirm_margin=60)
    (c,) = state.configs
    c.points += [S.Point(7, S.OOM, job="0"), S.Point(6, S.OK, 150, job="0", first=False)]
    assert S.next_job(c, state) == S.Job([6], 6)
    again = S.Point(6, S.OK, 140, job="1")
    assert S.adds_to(c, again) and not S.adds_to(c, S.Point(6, S.OK, 150, job="2", first=False))
    c.points.append(again)
    assert not S.adds_to(c, S.Point(6, S.OK, 140, job="3")) and S.done(c, state) and S.largest_ok(c, BATCHES) == 6
    c.points[-1] = S.Point(6, S.OOM, job="1")  # as a first point it ran out: 6 is past the budget
    assert S.bracket(c, BATCHES)[1] == BATCHES.index(6) and not S.done(c, state)


def test_a_later_answer_with_room_under_the_budget_is_not_confirmed():
    """Headroom at least the margin: the later point stands (6 ran at 150 of 200, margin 50); less, it is run again."""
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=200, confirm_margin=50)
    (c,) = state.configs
    c.points += [S.Point(7, S.OOM, job="0"), S.Point(6, S.OK, 150, job="0", first=False)]
    assert S.done(c, state)
    c.confirm_margin = 51
    assert not S.done(c, state) and S.next_job(c, state) == S.Job([6], 6)
    c.points[-1].peak = None  # no peak measured: no headroom known, confirmed
    c.confirm_margin = 1
    assert not S.done(c, state)


def test_without_a_confirm_margin_the_answer_may_be_a_later_point():
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=200)
    state.configs[0].replayed = BATCHES.index(17)
    assert run_jobs(state, lambda c: 16, fresh_of=lambda c: 15) == [("a", [17, 16])]
    assert S.largest_ok(state.configs[0], BATCHES) == 16  # what a fresh process's first generate would not run


def test_a_neighbours_gap_does_not_move_a_guess_the_replay_already_holds():
    """The neighbour measured a reserved peak far above its allocated prediction (the allocator's fragmentation);
    a configuration whose guess is the replay's starts there, not shifted under it by that gap again."""
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=160, configs=("a", "b"))
    a, b = state.configs
    a.points.append(S.Point(10, S.OK, 150, job="0"))  # predicted 100 at batch 10: a gap of 50
    a.points.append(S.Point(11, S.OOM, job="0"))
    # its out-of-memory point at 11 says at least 160 - 110 + 1
    assert S.gap(b, state) == 51 and S.next_job(b, state).start == 10
    b.replayed = BATCHES.index(12)
    assert S.gap(b, state) == 0 and S.next_job(b, state).start == 12


# --- where the caching allocator decided: the same configuration with expandable segments -------------------------


def test_a_bracket_whose_first_miss_fit_in_bytes_was_decided_by_the_allocator():
    state = one_load_state(lambda k: [b * 10 for b in BATCHES], device=160)
    (c,) = state.configs
    c.points += [S.Point(11, S.OK, 150, job="0"), S.Point(12, S.OOM, job="0")]  # 120 <= 160: the bytes fit
    assert S.done(c, state) and S.allocator_decided(c, state)
    c.points[1:] = [S.Point(17, S.OOM, job="0")]  # 170 > 160: the bytes did not fit
    c.points.append(S.Point(16, S.OK, 160, job="0"))
    assert S.done(c, state) and not S.allocator_decided(c, state)


def test_the_twin_is_dsexps_own_gpu_configuration_with_expandable_segments_and_only_that(tmp_path):
    from dataclasses import asdict

    from dsexp.compose.budget.sweeper import EXPANDABLE_OVERRIDE, allocator_twin
    from dsexp.engines.placement import strategy_of
    from dsexp.predict.job import Facts

    from helpers.run import spec_of

    gpu = spec_of("tp=2")
    gpu.device = "cuda"  # as a GPU machine composes it (validation refuses cuda where no GPU is visible)
    c = S.Config("tp=2", {"tp": "2"}, [1], one_load=True)
    assert allocator_twin(gpu, ["tp=2"], c) == ["tp=2", EXPANDABLE_OVERRIDE]
    twin = spec_of("tp=2", EXPANDABLE_OVERRIDE)
    assert twin.trim.env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert strategy_of(
        asdict(twin), Facts()
    ).expandable_segments  # the memory model replays it with expandable segments
    twin.device = "cuda"
    assert allocator_twin(twin, ["tp=2", EXPANDABLE_OVERRIDE], c) is None  # already
    assert allocator_twin(spec_of("tp=2"), ["tp=2"], c) is None  # device=cpu: no caching allocator
    assert allocator_twin(gpu, ["tp=2"], S.Config("k", {}, [1], twin_of="tp=2")) is None


def test_only_dsexps_own_workload_on_a_gpu_confirms_its_answer_as_a_first_point():
    from dsexp.compose.budget.sweeper import GIB, confirm_margin

    from helpers.run import spec_of

    gpu = spec_of("tp=2")
    gpu.device = "cuda"  # as a GPU machine composes it
    assert confirm_margin(gpu) == GIB // 2 and confirm_margin(spec_of("tp=2")) == 0  # device=cpu: simulated budget
    gpu.budget.one_load = False  # a job per guess: every point is its job's first or the one after it
    assert confirm_margin(gpu) == 0
    gpu.budget.one_load, gpu.budget.confirm_first = True, False
    assert confirm_margin(gpu) == 0


def test_the_answer_gives_both_batches_and_the_environment_line():
    from dsexp.analysis.sections.budget_answer import allocator_lines

    state = {
        "configs": [
            {"key": "tp=2", "largest_ok": 10, "smallest_oom": 11, "allocator_decided": True},
            {"key": "tp=2 allocator=expandable_segments", "twin_of": "tp=2", "largest_ok": 15, "settled": True},
            {"key": "tp=4 script", "largest_ok": 3, "smallest_oom": 4, "allocator_decided": True},
        ]
    }
    first, second = allocator_lines(state)
    assert first.startswith("- The allocator decided `tp=2`: batch 10 ran with the default caching allocator and 11")
    assert "with expandable segments its largest batch is 15" in first
    assert "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`" in first
    assert second.startswith("- The allocator decided `tp=4 script`") and "script.fix=context" in second


def test_a_twin_that_ran_out_with_room_left_too_is_said_so_not_sent_back_to_the_default_allocator():
    """llama_20b_shapes at tp=2 under 24 GiB (H100, 2026-12-06): with expandable segments batch 11 also ran out of
    memory though its bytes fit; the answer said that twin was 'searched with the default allocator only'."""
    from dsexp.analysis.sections.budget_answer import allocator_lines

    twin = {"key": "as given allocator=expandable_segments", "twin_of": "as given", "largest_ok": 10,
            "smallest_oom": 11, "settled": True, "allocator_decided": True}  # fmt: skip
    own = {"key": "mine", "overrides": ["++trim.env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"],
           "largest_ok": 4, "smallest_oom": 5, "allocator_decided": True}  # fmt: skip
    base = {"key": "as given", "largest_ok": 7, "smallest_oom": 8, "allocator_decided": True}
    (line,) = allocator_lines({"configs": [base, twin, own]})
    assert "with expandable segments its largest batch is 10" in line
    assert line.endswith("With them too, batch 11 ran out of memory though its bytes fit.")
