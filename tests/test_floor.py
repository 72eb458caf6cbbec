"""A floor is a floor: the memory model's per-GPU floor (weights' reserve + KV cache + the memory the run measured
outside PyTorch's allocator), and the floor a run is held to (the same with every term the capacity model predicts at
its largest point that ran: activations, logits, workspaces) never sit above the per-GPU peak they claim to bound,
for every committed H200 run that finished (results/h200/). Runs whose ranks shared one GPU are held to each rank's
own peak, as the report shows it."""

from __future__ import annotations

import json

import pytest

from dsexp.analysis.memory import predict, workload_floor

from helpers.run import ROOT

RUNS = sorted((ROOT / "results" / "h200").rglob("result.json"))


def finished_gpu_runs():
    out = []
    for path in RUNS:
        result = json.loads(path.read_text())
        if result.get("status") == "ok" and (result.get("runtime") or {}).get("device") == "cuda":
            out.append(path)
    return out


def test_the_committed_h200_runs_are_there():
    assert len(finished_gpu_runs()) >= 40  # 42 at the time of writing: a lost folder would empty the check below


@pytest.mark.parametrize("path", finished_gpu_runs(), ids=lambda p: str(p.relative_to(ROOT / "results" / "h200")))
def test_the_floor_never_sits_above_the_measured_peak(path):
    result = json.loads(path.read_text())
    prediction = predict(result)
    peak = result["headline"]["gpu_peak_gib"] * 2**30
    assert prediction.overhead is not None  # every finished H200 run measured what lies outside the allocator
    assert prediction.floor() <= peak, (
        f"floor {prediction.floor() / 2**30:.3f} GiB above the measured {peak / 2**30:.3f} GiB "
        f"(outside the allocator: {prediction.overhead / 2**30:.3f} GiB)"
    )
    floor = workload_floor(result, prediction)
    rounding = 2**30 // 2000  # the headline's peak is rounded to 0.001 GiB
    assert floor is None or floor["bytes"] <= peak + rounding, (
        f"the floor at batch {floor['batch']} ({floor['terms']}) above the measured {peak / 2**30:.3f} GiB"
    )
