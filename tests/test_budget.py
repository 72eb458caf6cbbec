"""The budget: its config, its refusals before launch, the sweeper that turns a sweep into a search, the report."""

from __future__ import annotations

import pytest

from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate
from dsexp.core.schema import ConfigError

from helpers.run import compose

GIB = 2**30
BUDGET = ["budget.gpus=2", "budget.gpu_gib=24"]


def checked(overrides, gpus=0, gpu_total=None):
    return validate(to_schema(compose(overrides)), gpus=gpus, gpu_total=gpu_total)


def test_no_budget_by_default_and_the_key_of_a_run_without_one_is_unchanged():
    from dsexp.job.run import job_key

    spec = checked([])
    assert not spec.budget.active
    with_budget = checked([*BUDGET])
    assert with_budget.budget.active and with_budget.budget.gpu_gib == 24
    assert job_key(spec) != job_key(with_budget)
    assert job_key(spec) == job_key(checked(["budget.batch_max=8"]))  # an inactive budget is not part of the key


@pytest.mark.parametrize(
    "overrides, gpus, total, needle",
    [
        (["budget.gpu_gib=24"], 0, None, "names both the GPUs and the memory"),
        (["budget.gpus=0", "budget.gpu_gib=24"], 0, None, "must be > 0"),
        ([*BUDGET, "budget.batch_min=8", "budget.batch_max=4"], 0, None, "batch_min <= batch_max"),
        ([*BUDGET, "budget.host_gib=1000000"], 0, None, "but this machine has"),
        ([*BUDGET, "device=cuda"], 1, 141 * GIB, "budget.gpus=2 but only 1 GPUs are visible"),
        (["budget.gpus=1", "budget.gpu_gib=200", "device=cuda", "dtype=bf16"], 1, 141 * GIB, "the GPU has 141.0 GiB"),
        (
            ["budget.gpus=4", "budget.gpu_gib=40", "device=cuda", "tp=4", "launcher.gpus=1"],
            1,
            141 * GIB,
            "4 ranks sharing one GPU x 40.0 GiB = 160.0 GiB but the GPU has 141.0 GiB; allowed: budget.gpu_gib <= 35.2",
        ),
    ],
)
def test_a_budget_larger_than_what_is_here_is_refused_with_both_numbers(overrides, gpus, total, needle):
    with pytest.raises(ConfigError) as e:
        checked(overrides, gpus, total)
    assert needle in str(e.value)


def test_a_budget_within_the_gpu_at_hand_passes():
    spec = checked(["budget.gpus=4", "budget.gpu_gib=24", "device=cuda", "tp=4", "launcher.gpus=1"], 1, 141 * GIB)
    assert spec.budget.gpus == 4
    spec = checked(["budget.gpus=2", "budget.gpu_gib=24", "device=cuda", "tp=2"], 2, 141 * GIB)
    assert spec.device == "cuda"


# --- the search end to end, on CPU (the device budget simulated: dsexp.rank.budget_cap) ---------------------------

SEARCH = ["-m", "model=tiny", "debug=fast", "generate.prompt_tokens=64"]


def needs(tp: int, batches, *extra: str):
    """The memory model's device need (busiest rank) at each batch, as the search predicts it."""
    from dsexp.compose.budget.model import predict_config

    from helpers.run import spec_of

    spec = spec_of("model=tiny", "debug=fast", "generate.prompt_tokens=64", f"tp={tp}", *extra)
    return predict_config(spec, list(batches)).needs


def read_state(sweep):
    import json

    return json.loads((sweep / "budget.json").read_text())


@pytest.mark.slow  # two dsexp processes and a job of one rank: 280 s on the 2 shared cores (most of it imports)
def test_a_budget_search_on_cpu_skips_the_miss_and_settles_in_one_job_then_resumes_with_nothing_to_do(
    tmp_path, cache_dir
):
    """tp=2 takes more GPUs than the budget has: not launched. tp=1, with the model exact on the CPU
    (cpu_scale=1), runs the model's largest batch and the next one in one job: the first runs, the second is out of
    memory (a result), a one-step bracket. Run again on the same folder: the search resumes with nothing left."""
    from helpers.run import run_dsexp, sweep_results

    batches = range(1, 9)
    tp1 = needs(1, batches, "budget.gpus=1", "budget.gpu_gib=1")
    budget = (tp1[2] + tp1[3]) // 2  # between batch 3 and batch 4
    args = [*SEARCH, "budget.gpus=1", f"budget.gpu_gib={budget / GIB!r}", "budget.batch_max=8", "tp=1,2"]
    out = run_dsexp([*args, "hydra.sweep.dir=sw"], tmp_path, cache_dir).stdout
    sweep = tmp_path / "sw"
    state = read_state(sweep)
    by_key = {c["key"]: c for c in state["configs"]}
    assert by_key["tp=2"]["miss"]["where"] == "gpus" and by_key["tp=2"]["points"] == []
    assert "not launched: tp=2: tp=2 needs 2 GPUs; the budget has 1" in out
    c = by_key["tp=1"]
    assert [(p["batch"], p["status"]) for p in c["points"]] == [(3, "ok"), (4, "oom")]
    assert (c["largest_ok"], c["smallest_oom"], state["runs"], len(state["jobs"])) == (3, 4, 2, 1)
    (res,) = sweep_results(sweep)
    assert res["status"] == "ok" and res["config"]["generate"]["batch_size"] == [3, 4]
    summary = (sweep / "summary.md").read_text()
    assert "## Budget search" in summary and "**Answer**: `tp=1` at batch **3**" in summary
    assert "simulated on the CPU" in summary and "2 points in 1 jobs, against 16 for the full grid" in summary
    assert "- `tp=2`: tp=2 needs 2 GPUs; the budget has 1" in summary
    again = run_dsexp([*args, "hydra.sweep.dir=sw"], tmp_path, cache_dir).stdout
    assert "resumed from 1 jobs" in again and len(sweep_results(sweep)) == 1
    assert read_state(sweep)["runs"] == 2
