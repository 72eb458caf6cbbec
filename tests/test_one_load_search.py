"""A batch search inside one load (generate.bisect_from, dsexp.core.bisect) on the CPU at tp=2: the model loads once,
each batch is a point, a point out of memory is agreed on by both ranks and the next batch runs in the same
processes; where one rank alone runs out inside the forward, the ranks end and the job relaunches them to go on from
what was measured."""

from __future__ import annotations

import pytest

from helpers.run import run_dsexp, sweep_results

pytestmark = pytest.mark.timeout(1200)
BATCHES = "[1,2,3,4,5,6,7,8]"


def run_search(tmp_path, cache_dir, fault: str, start: int = 6):
    """One tp=2 job searching batches 1..8 of 8-token prompts from `start`; points of 32 tokens or more (batch >= 4)
    run out of memory as `fault` says (kind oom: on every rank, before the forward; oom_forward: inside it)."""
    run_dsexp(
        [
            "tp=2",
            "debug=fault",
            f"fault={fault}",
            "check.correctness=false",
            "probe.sample_ms=0",
            "probe.see_memory_usage=false",
            f"generate.batch_size={BATCHES}",
            f"generate.bisect_from={start}",
            "generate.prompt_tokens=8",
            "generate.new_tokens=2",
            "generate.warmup=0",
            "timeout_s=400",
            "launcher.grace_s=8",
            "tracking=none",  # read from result.json
            "hydra.run.dir=job",
        ],
        tmp_path,
        cache_dir,
    )
    import json

    return json.loads((tmp_path / "job" / "result.json").read_text())


def ran(rank):
    return [(p["batch"], p["status"]) for p in rank["points"] if p["status"] in ("ok", "oom")]


# the search from 6 on a card whose largest batch is 3: down one, one more, then by twice the step, then bisected
ORDER = [(6, "oom"), (5, "oom"), (4, "oom"), (2, "ok"), (3, "ok")]


def test_every_rank_out_of_memory_goes_on_in_the_same_load_to_a_one_step_bracket(tmp_path, cache_dir):
    res = run_search(tmp_path, cache_dir, "{kind:oom,at_tokens:32}")
    assert res["status"] == "ok", res.get("failure")
    assert "launches" not in res  # one launch: the model loaded once
    for rank in res["ranks"]:
        assert ran(rank) == ORDER
        assert [p["oom_ranks"] for p in rank["points"] if p["status"] == "oom"] == [[0, 1]] * 3
        # the points up to the first that ran make (or were to make) the logits call, of the first sequence alone
        assert [p.get("logits_batch") for p in rank["points"] if p["status"] in ("ok", "oom")] == [1, 1, 1, 1, None]
        loads = [e for e in rank["timeline"] if e["phase"] == "load"]
        assert len(loads) == 1
    # the points not tried are listed as not run, with why
    assert {p["batch"] for p in res["ranks"][0]["points"]} <= set(range(1, 9))
    from dsexp.analysis.labels import config_label

    assert config_label(res["config"]).endswith("/b1..8?xL8")  # a search over its range, not a grid of 8 points


@pytest.mark.slow  # three launches of two ranks (each out-of-memory point of rank 1 alone ends one): ~2 min here
def test_a_rank_out_of_memory_alone_ends_the_launch_and_the_next_launch_goes_on_from_what_was_measured(
    tmp_path, cache_dir
):
    res = run_search(tmp_path, cache_dir, "{kind:oom_forward,rank:1,at_tokens:32}", start=4)
    assert res["status"] == "ok", res.get("failure")
    # 4 out of memory on rank 1 alone: relaunched; then 3 ran, settled
    assert [launch["ended"]["oom_ranks"] for launch in res["launches"]] == [[1]]
    assert res["launches"][0]["relaunched_for"] == [{"batch": 3, "prompt_tokens": 8}]
    for rank in res["ranks"]:
        assert ran(rank) == [(3, "ok"), (4, "oom")]  # every launch's points, merged in the grid's order
        not_run = [p for p in rank["points"] if p["status"] == "not_run"]
        assert not_run and all(p["why"] == "the batch search settled without it" for p in not_run)


def test_a_search_is_refused_before_launch_where_it_cannot_run(tmp_path, cache_dir):
    from dsexp.compose.validate import ConfigError, validate
    from dsexp.core.schema import JobConfig

    spec = JobConfig()
    spec.generate.batch_size, spec.generate.bisect_from, spec.generate.prompt_tokens = [1, 2, 4], 3, 8
    with pytest.raises(ConfigError, match="bisect_from=3: not among generate.batch_size"):
        validate(spec)
    spec.generate.bisect_from, spec.generate.prompt_tokens = 2, [8, 16]
    with pytest.raises(ConfigError, match="one prompt length"):
        validate(spec)


def test_the_sweep_of_a_search_finds_its_jobs(tmp_path):
    assert sweep_results(tmp_path) == []
