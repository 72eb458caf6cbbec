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
