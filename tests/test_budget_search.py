"""The budget search's algorithm (dsexp.compose.budget.search) against simulated cards: pure, no ranks."""

from __future__ import annotations

import itertools
import math

import pytest

from dsexp.compose.budget import search as S
from dsexp.core.bisect import next_batch

GIB = 2**30


def linear_needs(batches, weights, per_batch):
    return [weights + per_batch * b for b in batches]


def simulate(state: S.State, truth, width: int = 1, max_rounds: int = 500):
    """Run the search to its end on cards whose real need at batch b is truth(config, b); returns the jobs run."""
    jobs = []
    for _ in range(max_rounds):
        todo = S.next_round(state, width)
        if not todo:
            return jobs
        for c, job in todo:
            ran = run_job(state, c, job, truth, len(jobs))
            jobs.append((c.key, ran))
    raise AssertionError("the search did not settle")


def run_job(state: S.State, c: S.Config, job: S.Job, truth, number: int):
    """The job's points as its ranks would run them: every batch, or the search inside the load
    (dsexp.core.bisect); returns the batches run."""
    outcomes, ran = {}, []
    batch = job.batches[0] if job.start is None else job.start
    while batch is not None:
        need = truth(c, batch)
        fits = need <= state.device
        c.points.append(S.Point(batch, S.OK if fits else S.OOM, need if fits else None, job=str(number)))
        outcomes[batch], ran = S.OK if fits else S.OOM, [*ran, batch]
        if job.start is None:
            rest = [b for b in job.batches if b not in outcomes]
            batch = rest[0] if rest else None
        else:
            batch = next_batch(job.batches, job.start, outcomes)
    return ran


def true_largest(state, c, truth):
    ok = [b for b in state.batches if truth(c, b) <= state.device]
    return max(ok, default=None)


def space(batches, factors, weights_of):
    configs = []
    for tp, trim in itertools.product((1, 2), ("none", "all")):
        key = f"tp={tp} trim={trim}"
        configs.append(
            S.Config(key, {"tp": str(tp), "trim": trim}, linear_needs(batches, weights_of(tp, trim), 10**6), gpus=tp)
        )
    return configs


@pytest.mark.parametrize("scale", [1.0, 1.3, 3.0, 0.7])
def test_every_configuration_ends_in_a_one_step_bracket_within_the_bound(scale):
    """Whether the model is exact, optimistic (the card needs more) or pessimistic, each configuration ends with the
    largest batch that ran and the smallest that did not one step apart, the true boundary, within the run bound."""
    batches = S.batch_range(1, 256, 1)
    state = S.State(device=400 * 10**6, batches=batches, configs=space(batches, None, lambda tp, t: 100 * 10**6 // tp))

    def truth(c, b):
        return c.needs[0] - 10**6 + int(10**6 * scale) * b

    simulate(state, truth)
    bound = S.run_bound(len(batches))
    assert bound == math.ceil(math.log2(256)) + 2
    for c in state.configs:
        assert S.runs_used(c) <= bound, (c.key, [p.batch for p in c.points])
        want = true_largest(state, c, truth)
        assert S.largest_ok(c, batches) == want, c.key
        lo, hi = S.bracket(c, batches)
        assert hi - lo == 1


def test_an_exact_model_settles_each_configuration_in_one_job_of_two_runs():
    batches = S.batch_range(1, 64, 1)
    configs = space(batches, None, lambda tp, t: 10 * 10**6 * (2 if t == "none" else 1) // tp)
    state = S.State(device=50 * 10**6, batches=batches, configs=configs)
    jobs = simulate(state, lambda c, b: c.needs[batches.index(b)])
    assert len(jobs) == len(configs)
    assert all(len(b) == 2 for _, b in jobs)


def test_predicted_misses_are_never_launched():
    batches = S.batch_range(1, 32, 1)
    configs = space(batches, None, lambda tp, t: 10**6)
    configs[0].miss = S.Miss("weights", 30 * GIB, 24 * GIB)
    configs[1].miss = S.Miss("gpus", 4, 2, where="gpus")
    state = S.State(device=20 * 10**6, batches=batches, configs=configs)
    jobs = simulate(state, lambda c, b: c.needs[batches.index(b)])
    assert {k for k, _ in jobs} == {configs[2].key, configs[3].key}
    assert configs[0].points == [] and configs[1].points == []


def test_nothing_fits_at_the_smallest_batch_is_settled_by_its_out_of_memory():
    batches = S.batch_range(1, 16, 1)
    c = S.Config("tp=1", {"tp": "1"}, linear_needs(batches, 10, 1))
    state = S.State(device=100, batches=batches, configs=[c])
    simulate(state, lambda c, b: 1000)  # the card needs far more than the model says
    assert S.largest_ok(c, batches) is None
    assert S.bracket(c, batches) == (-1, 0)
    assert S.runs_used(c) <= S.run_bound(16)


def test_the_top_of_the_range_running_settles_the_configuration():
    batches = S.batch_range(8, 64, 8)
    c = S.Config("tp=1", {"tp": "1"}, linear_needs(batches, 10, 1))
    state = S.State(device=10**9, batches=batches, configs=[c])
    jobs = simulate(state, lambda c, b: 1)
    assert jobs == [("tp=1", [64])] and S.largest_ok(c, batches) == 64


def test_a_gap_measured_on_one_configuration_moves_its_neighbours_first_guess():
    """tp=1 is measured first (best predicted) and needs 20 MB more than predicted; its neighbour tp=1/trim=all,
    not yet measured, has its first guess lowered by that gap, and lands on its true boundary in one job."""
    batches = S.batch_range(1, 128, 1)
    extra = 20 * 10**6
    configs = [
        S.Config("a", {"tp": "1", "trim": "none"}, linear_needs(batches, 10**6, 10**6)),
        S.Config("b", {"tp": "1", "trim": "all"}, linear_needs(batches, 2 * 10**6, 10**6)),
        S.Config("c", {"tp": "2", "trim": "all"}, linear_needs(batches, 3 * 10**6, 10**6), gpus=2),  # not a neighbour
    ]
    state = S.State(device=100 * 10**6, batches=batches, configs=configs)

    def truth(c, b):
        return c.needs[batches.index(b)] + (extra if c.key in ("a", "b") else 0)

    jobs = simulate(state, truth)
    assert jobs[0][0] == "a"  # the largest predicted batch first
    assert S.own_gap(configs[0], batches, state.device) == extra
    first_b = next(bs for k, bs in jobs if k == "b")
    assert first_b[0] == true_largest(state, configs[1], truth)
    assert [k for k, _ in jobs].count("b") == 1
    for c in configs:
        assert S.largest_ok(c, batches) == true_largest(state, c, truth)


def test_an_out_of_memory_point_the_model_said_fits_gives_a_gap_of_at_least_the_shortfall():
    batches = [1, 2, 3]
    c = S.Config("a", {"tp": "1"}, [10, 20, 30], points=[S.Point(2, S.OOM)])
    assert S.own_gap(c, batches, device=50) == 31  # needed > 50 where 20 was predicted
    c.points = [S.Point(1, S.OK, peak=8)]  # below the prediction: no negative shift
    assert S.own_gap(c, batches, device=50) == 0


def test_a_failed_configuration_stops_and_the_others_go_on():
    batches = S.batch_range(1, 8, 1)
    a = S.Config("a", {"tp": "1"}, [1] * 8)
    b = S.Config("b", {"tp": "2"}, [1] * 8)
    a.failed = "engine refused"
    state = S.State(device=10, batches=batches, configs=[a, b])
    assert [c.key for c, _ in S.next_round(state, width=4)] == ["b"]


def test_first_failing_term_names_the_term_that_crosses_the_budget_and_the_overshoot():
    terms = {"weights": 20, "context": 1, "kv_cache": 5, "activations": 4}
    assert S.first_failing_term(terms, 24) == ("kv_cache", 6)
    assert S.first_failing_term(terms, 30) is None
    assert S.first_failing_term(terms, 10) == ("weights", 20)


def test_the_bound_holds_whatever_the_model_gets_wrong():
    """Random models against random cards (monotone needs): the bracket is always the true boundary, in bound."""
    import random

    rng = random.Random(0)
    for trial in range(300):
        n = rng.randint(1, 300)
        batches = S.batch_range(1, n, 1)
        slope, base, device = rng.randint(1, 50), rng.randint(0, 500), rng.randint(100, 5000)
        c = S.Config("a", {"tp": "1"}, linear_needs(batches, base, slope))
        tslope, tbase = rng.randint(1, 80), rng.randint(0, 800)
        state = S.State(device=device, batches=batches, configs=[c])
        simulate(state, lambda c, b: tbase + tslope * b)
        assert S.runs_used(c) <= S.run_bound(n), (trial, [p.batch for p in c.points])
        assert S.largest_ok(c, batches) == true_largest(state, c, lambda c, b: tbase + tslope * b), trial


def test_a_point_that_ran_past_the_budget_is_the_upper_side_and_its_measured_gap_counts():
    batches = [1, 2, 3, 4]
    c = S.Config("a", {"tp": "1"}, [10, 20, 30, 40], points=[S.Point(1, S.OK, 12), S.Point(3, S.OVER, 45)])
    assert S.bracket(c, batches) == (0, 2)  # 1 ran within the budget, 3 ran past it
    assert S.own_gap(c, batches, device=40) == 15  # the measured 45 where 30 was predicted


def test_after_out_of_memory_alone_the_search_bisects_instead_of_stepping_down_one_batch():
    """The H200 at 40 GiB: the model said 16 fits, the allocator's fragmentation made everything from 13 up run out
    of memory. An out-of-memory point only bounds the need from below, so the search bisects (it stepped down 16,
    15, 14, 13 one job each before), and it still ends on the true boundary within the bound."""
    batches = S.batch_range(1, 64, 1)
    c = S.Config("tp=2", {"tp": "2"}, linear_needs(batches, 22 * GIB, GIB))
    state = S.State(device=40 * GIB, batches=batches, configs=[c])

    def truth(c, b):  # ~4 GiB more than the model at every batch: 13 and up do not fit
        return 26 * GIB + b * GIB + GIB // 2

    jobs = simulate(state, truth)
    assert jobs[0][1] == [18, 19]  # the model's guess first (18 fits by its count), then halves
    assert jobs[1][1] == [9]
    assert S.largest_ok(c, batches) == 13 and S.runs_used(c) <= S.run_bound(64), jobs


def test_a_configuration_whose_job_runs_one_batch_brackets_within_the_same_bound():
    """A user's script takes its batch as an argument ({batch_size}): each job runs one batch. Random models against
    random cards: every job holds one batch, the bracket is the true boundary, and the runs (jobs) stay in the bound."""
    import random

    rng = random.Random(1)
    for trial in range(300):
        n = rng.randint(1, 300)
        batches = S.batch_range(1, n, 1)
        slope, base, device = rng.randint(1, 50), rng.randint(0, 500), rng.randint(100, 5000)
        c = S.Config("a", {"tp": "1"}, linear_needs(batches, base, slope), one_batch=True)
        tslope, tbase = rng.randint(1, 80), rng.randint(0, 800)
        state = S.State(device=device, batches=batches, configs=[c])
        jobs = simulate(state, lambda c, b: tbase + tslope * b)
        assert all(len(bs) == 1 for _, bs in jobs), trial
        assert len(jobs) == S.runs_used(c) <= S.run_bound(n), (trial, [p.batch for p in c.points])
        assert S.largest_ok(c, batches) == true_largest(state, c, lambda c, b: tbase + tslope * b), trial


def test_an_exact_model_settles_a_one_batch_configuration_in_two_jobs():
    batches = S.batch_range(1, 64, 1)
    c = S.Config("a", {"tp": "1"}, linear_needs(batches, 10, 3), one_batch=True)
    state = S.State(device=100, batches=batches, configs=[c])
    jobs = simulate(state, lambda c, b: c.needs[batches.index(b)])
    assert jobs == [("a", [30]), ("a", [31])]  # 10 + 3 x 30 = 100 fits, 31 does not


def test_the_floors_first_miss_bounds_the_bisection_so_a_low_guess_does_not_send_it_to_the_middle_of_the_range():
    """The H200 at 24 GiB, tp=2 trim=all (results/h200/budget/gpu24): a neighbour's gap made the first job run 1 and
    2, both ran; then, with nothing known above, the run bound sent the bisection to 33, 17, 9, 5 and 3, all out of
    memory. The model (a floor) says 5 does not fit, so nothing above 5 is run: the guess and the floor's first miss
    in one job, then the batch below."""
    batches = S.batch_range(1, 64, 1)
    c = S.Config("tp=2 trim=all", {"tp": "2"}, linear_needs(batches, 18 * GIB, GIB + GIB // 4))
    state = S.State(device=24 * GIB, batches=batches, configs=[c])
    assert S.model_largest(c, state.device) == batches.index(4)  # 18 + 4 x 1.25 = 23 GiB fits, 5 does not
    c.points = [S.Point(1, S.OK, c.needs[0] + GIB // 8), S.Point(2, S.OK, c.needs[1] + GIB // 8)]
    assert S.floor_cap(c, state) == batches.index(5)

    def truth(c, b):  # fragmentation: 1.5 GiB more than the model, so 4 runs out
        return c.needs[batches.index(b)] + 3 * GIB // 2

    jobs = simulate(state, truth)
    assert jobs == [("tp=2 trim=all", [4, 5]), ("tp=2 trim=all", [3])], jobs
    assert S.largest_ok(c, batches) == 3 and S.bracket(c, batches) == (2, 3)


def test_a_model_measured_above_a_point_is_no_floor_and_the_whole_range_is_bisected():
    """A point that ran below its prediction: the model is not a floor for that configuration, its first predicted
    miss bounds nothing, and the search finds the true boundary above it."""
    batches = S.batch_range(1, 64, 1)
    c = S.Config("a", {"tp": "1"}, linear_needs(batches, 10 * GIB, GIB))
    state = S.State(device=24 * GIB, batches=batches, configs=[c])
    c.points = [S.Point(14, S.OK, 20 * GIB)]  # the model said 24 GiB at 14
    assert S.floor_cap(c, state) == len(batches)
    jobs = simulate(state, lambda c, b: 6 * GIB + GIB * b // 2)  # 36 fits, 37 does not
    assert S.largest_ok(c, batches) == 36 and S.runs_used(c) <= S.run_bound(64), jobs


def test_the_allocators_replay_lowers_the_models_first_guess():
    """The allocated bytes fit batches up to 16; the replay (fragmentation) up to 14: the first guess is 14."""
    GIB = 2**30
    needs = [b * GIB for b in range(1, 21)]
    plain = S.Config("a", {}, needs)
    replayed = S.Config("a", {}, needs, replayed=13)  # index of batch 14
    assert S.model_largest(plain, 16 * GIB) == 15 and S.model_largest(replayed, 16 * GIB) == 13
    assert S.model_largest(S.Config("a", {}, needs, replayed=-1), 16 * GIB) == -1


def test_a_gpu_configuration_is_replayed_before_the_search_and_one_under_kernel_injection_is_not():
    from dsexp.compose.budget.model import predict_config

    from helpers.run import spec_of

    common = [
        "model=tiny",
        "device=cuda",
        "budget.gpus=2",
        "budget.gpu_gib=0.75",
        "generate.prompt_tokens=256",
        "generate.new_tokens=2",
    ]
    batches = list(range(1, 41))
    one = predict_config(spec_of(*common, "tp=1", gpus=2), batches)
    allocated = max(b for b, need in zip(batches, one.needs) if need <= 0.75 * 2**30)
    assert one.replayed is not None and 0 < one.replayed <= allocated
    assert predict_config(spec_of(*common, "tp=1", "engine.kernel_inject=true", gpus=2), batches).replayed is None


@pytest.mark.network  # the other transformers' overlay, from the package index
def test_the_guess_of_a_stack_pinning_another_transformers_is_traced_in_that_stack(cache_dir):
    """The search's guess is held to a replay traced under the transformers the configuration's ranks will run: in
    the stack's overlay (prepared as a sweep prepares it: the package index the first time) where it pins another
    than this environment's; here where it pins this one. A stack that cannot be prepared is replayed here, under
    this environment's transformers, and says why."""
    from dsexp.compose.budget.model import predict_config
    from dsexp.predict.job import installed

    from helpers.run import spec_of

    here = installed("transformers")
    other = "5.17.0" if here != "5.17.0" else "5.24.0"
    common = ["model=tiny_llama", "device=cuda", "budget.gpus=1", "budget.gpu_gib=0.72", f"cache_dir={cache_dir}",
              "generate.prompt_tokens=64", "generate.new_tokens=4"]  # fmt: skip
    batches = list(range(1, 65))
    away = predict_config(spec_of(*common, f"stack.transformers={other}", gpus=1), batches)
    home = predict_config(spec_of(*common, f"stack.transformers={here}", gpus=1), batches)
    assert away.replay == {"traced_with": f"transformers {other}", "in_stack": True}, away.replay
    assert home.replay == {"traced_with": f"transformers {here}"}, home.replay
    allocated = max(b for b, need in zip(batches, away.needs) if need <= 0.72 * 2**30)  # 35 of the 64
    assert away.replayed is not None and 0 < away.replayed <= allocated < batches[-1]
    assert home.replayed is not None and 0 < home.replayed <= allocated
    broken = predict_config(spec_of(*common, "stack.transformers=5.999.0", gpus=1), batches)
    assert broken.replay["not_in_stack"].startswith("its stack could not be prepared"), broken.replay
    assert broken.replay["traced_with"] == f"transformers {here}" and "5.999.0" in broken.replay["version_note"]
    assert broken.replayed == home.replayed  # another version's replay rather than none
    older = predict_config(spec_of(*common, "stack.transformers=4.42.4", gpus=1), batches)  # not prepared for it
    assert older.replay["not_in_stack"] == "the trace needs transformers 5, the stack runs 4.42.4"
    assert older.replayed == home.replayed


def test_a_configuration_whose_generate_fails_as_a_rank_holds_it_is_predicted_by_its_bytes_and_says_why():
    """Falcon's multi-query fused qkv at tp=2 (AutoTP's run fails in generate, results/cpu/arch_matrix.md): the
    replay cannot trace it, so the guess is the allocated bytes' and the search records why, rather than stopping."""
    from dsexp.compose.budget.model import predict_config

    from helpers.run import spec_of

    common = ["model=tiny_falcon", "device=cuda", "tp=2", "budget.gpus=2", "budget.gpu_gib=0.72",
              "generate.prompt_tokens=64", "generate.new_tokens=2"]  # fmt: skip
    pred = predict_config(spec_of(*common, gpus=2), list(range(1, 65)))
    assert pred.miss is None and pred.replayed is None
    assert pred.replay["not_replayed"].startswith("its generate fails as rank 0 holds the model"), pred.replay


def run_fresh_loads(state: S.State, truth, max_rounds: int = 50):
    """One-load jobs as a GPU runs them when a load's first point runs out of memory: that point alone counts (the
    batches after it start with the failed point's blocks cached, dsexp.rank.workloads.pipeline.as_load)."""
    loads = []
    for _ in range(max_rounds):
        todo = S.next_round(state, 1)
        if not todo:
            return loads
        for c, job in todo:
            outcomes, batch, first = {}, job.start if job.start is not None else job.batches[0], True
            while batch is not None:
                fits = truth(c, batch) <= state.device
                c.points.append(S.Point(batch, S.OK if fits else S.OOM, truth(c, batch) if fits else None,
                                        job=str(len(loads)), first=first))  # fmt: skip
                if not fits and first:
                    break
                outcomes[batch], first = S.OK if fits else S.OOM, False
                batch = next_batch(job.batches, job.start, outcomes) if job.start is not None else None
            loads.append(job.start)
    raise AssertionError("the search did not settle")


def test_a_one_load_search_whose_first_points_run_out_of_memory_bisects_rather_than_walking_down():
    """fp8 on the H100 at 60 GiB (results/h200/quant budget60): the allocated bytes said 59, each load's first point
    ran out of memory, and the search walked down one batch a load (59, 58, 57, 56, 55). After its second first point
    out of memory it now bisects."""
    batches = S.batch_range(1, 96, 1)
    c = S.Config("quant=fp8", {"quant": "fp8"}, linear_needs(batches, 20 * GIB, GIB * 7 // 10), one_load=True)
    state = S.State(device=60 * GIB, batches=batches, configs=[c])
    loads = run_fresh_loads(state, lambda c, b: 20 * GIB + b * GIB * 11 // 10)  # the truth: 36 fits, 37 does not
    assert S.largest_ok(c, batches) == 36
    assert loads[:3] == [57, 56, 28] and len(loads) <= 5, loads  # the guess, one below it, then halfway down


def test_batches_past_a_kernels_limit_are_never_run_and_the_limit_settles_the_search():
    """int4's tinygemm kernel faults past 2^31 output elements (72 x 2048 tokens through a 16384-wide linear on the
    H100): the sweeper puts a `limit` point above its largest batch; no job runs a batch at or above it."""
    batches = S.batch_range(1, 96, 1)
    c = S.Config("quant=int4_weight", {"quant": "int4_weight"}, linear_needs(batches, 12 * GIB, GIB * 2 // 3),
                 one_load=True, points=[S.Point(64, S.LIMIT)])  # fmt: skip
    state = S.State(device=60 * GIB, batches=batches, configs=[c])
    ran = []

    def truth(c, b):
        ran.append(b)
        assert b < 64, "a batch past the kernel's limit was launched"
        return 12 * GIB + b * GIB * 2 // 3

    run_fresh_loads(state, truth)
    assert S.largest_ok(c, batches) == 63 and max(ran) == 63
    ran.clear()  # the same with a job per guess (not one load): its first job runs the guess and the batch above
    c = S.Config("quant=int4_weight", {"quant": "int4_weight"}, linear_needs(batches, 12 * GIB, GIB * 2 // 3),
                 replayed=62, points=[S.Point(64, S.LIMIT)])  # fmt: skip
    state = S.State(device=60 * GIB, batches=batches, configs=[c])
    simulate(state, truth)
    assert S.largest_ok(c, batches) == 63 and max(ran) == 63


def test_a_resumed_job_that_crashed_past_the_kernels_limit_leaves_the_search_going_under_it(capsys):
    """budget60_each's int4 job faulted at batch 72 before the limit (64) was known: resumed, that crash is the
    limit, not a failure of int4 (which then was never searched); a crash under the limit still stops it."""
    from pathlib import Path

    from dsexp.compose.budget import points as P
    from dsexp.compose.budget.sweeper import BudgetSearch

    def crashed_at(batch):
        config = {"quant": {"name": "int4_weight"}, "generate": {"batch_size": list(range(1, 74)), "bisect_from": 72}}
        failure = {"cause": "engine_error", "phase": f"generate[b={batch},l=2048]", "message": "illegal memory access"}
        return {"status": "failed", "job_dir": "j0", "config": config, "failure": failure, "ranks": []}

    for batch, stopped in ((72, False), (65, False), (64, True)):  # 64 ran under the limit: a real failure
        result = crashed_at(batch)
        bs = object.__new__(BudgetSearch)  # the search's state alone: no sweeper, no launcher
        bs.identity, bs.jobs = {"quant=int4_weight": P.identity(result["config"])}, []
        c = S.Config("quant=int4_weight", {}, [0] * 96, one_load=True, points=[S.Point(65, S.LIMIT)])
        bs.state = S.State(60 * GIB, S.batch_range(1, 96, 1), [c])
        bs.absorb(Path("j0"), result, resumed=True)
        assert bool(c.failed) is stopped, (batch, c.failed)
        assert ("failed past the kernel's limit" in capsys.readouterr().out) is not stopped
