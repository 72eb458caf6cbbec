"""The capacity analysis on GPU-shaped records (no GPU needed): what a rank measured above its weights at a point,
and the largest batch the memory model says fits the GPU the run had, against the largest that ran."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from dsexp.analysis import workload_points as capa
from dsexp.core.result import JobRecord
from dsexp.predict.architecture import Dims

GIB = 2**30


def gpu_result(points, shared=False):
    """A one-rank GPU job with the given {(batch, length): (status, prefill alloc peak, decode alloc peak)}."""
    phases = {
        "start": {"gpu": {"gpu_total": 140 * GIB}},
        "init": {"gpu": {"gpu_alloc": 10 * GIB}},
    }
    listed = []
    for (b, ln), (status, prefill, decode) in points.items():
        key = f"generate[b={b},l={ln}]"
        listed.append({"batch": b, "prompt_tokens": ln, "phase": key, "status": status})
        point = {"batch": b, "prompt_tokens": ln, "prompt_len": ln}
        if status == "ok":
            point.update(prefill={"gpu_alloc_peak": prefill}, decode={"gpu_alloc_peak": decode})
        else:
            point["out_of_memory"] = {"type": "OutOfMemoryError"}
        phases[key] = {"point": point}
    rank = {"rank": 0, "status": "ok", "phases": phases, "points": listed, "timeline": []}
    config = {
        "tp": 1,
        "model": {"name": "m"},
        "generate": {"new_tokens": 8, "batch_size": [1, 8], "prompt_tokens": [512]},
    }
    runtime = {"device": "cuda", **({"shared_gpu": True} if shared else {})}
    return {"status": "ok", "config": config, "runtime": runtime, "ranks": [rank]}


def row_of(result):
    dims = Dims(8, 8, 128, hidden=4096, intermediate=11008, heads=32, vocab=32000)
    strategy = SimpleNamespace(dtype="fp16", splits_weights=True, kernel_inject=False, max_out_tokens=1024)
    prediction = SimpleNamespace(dims=dims, strategy=strategy, reserve=[10 * GIB], overhead=GIB)
    return SimpleNamespace(
        result=result, record=JobRecord.of(result), config=result["config"], tp=1, prediction=prediction
    )


def test_measured_above_the_weights_is_the_higher_window_minus_the_weights_allocated_at_init():
    row = row_of(gpu_result({(1, 512): ("ok", 11 * GIB, 12 * GIB), (8, 512): ("oom", 0, 0)}))
    points = capa.point_rows([row])
    assert [(q.batch, q.status) for q in points] == [(1, "ok"), (8, "oom")]
    assert points[0].measured == [2 * GIB]  # the decode's 12 GiB - 10 GiB of weights
    assert points[1].measured == [None]  # ran out: nothing measured, the model's figure still shown
    assert points[1].predicted_max > points[0].predicted_max


def test_largest_batch_is_predicted_for_the_gpu_the_run_had_beside_what_ran():
    row = row_of(gpu_result({(1, 512): ("ok", 11 * GIB, 11 * GIB), (8, 512): ("oom", 0, 0)}))
    (fit,) = capa.largest_batches([row], capa.point_rows([row]))
    assert (fit.prompt_tokens, fit.ran, fit.out_of_memory) == (512, 1, 8)
    # 140 GiB - 10 GiB weights - 1 GiB outside, at ~0.063 GiB a sequence of 512 tokens (KV 16 MiB, MLP 48 MiB)
    assert 1900 < fit.predicted < 2100
    shared = row_of(gpu_result({(1, 512): ("ok", 11 * GIB, 11 * GIB)}, shared=True))
    shared.tp = 2  # two ranks on the one GPU: each gets half of it
    shared.prediction.reserve = [5 * GIB, 5 * GIB]
    (half,) = capa.largest_batches([shared], capa.point_rows([shared]))
    assert half.predicted < fit.predicted


def test_the_recommendation_states_the_workload_it_holds_for():
    from dsexp.analysis.sections.recommendation import workload_line

    row = row_of(gpu_result({(1, 512): ("ok", 11 * GIB, 11 * GIB)}))
    line = workload_line(row)
    assert "batch 1, 8, a prompt of 512 tokens, 8 new tokens (a grid" in line
    row.config["generate"] = {"new_tokens": 16}
    assert "batch 1, the prompt text" in workload_line(row) and "grid" not in workload_line(row)


def h200_capacity_results():
    from helpers.run import ROOT

    return sorted((ROOT / "results" / "h200" / "capacity").glob("*/*/result.json"))


def test_the_model_is_within_5_percent_of_every_h200_point_that_ran():
    """results/h200/capacity (campaigns/capacity.yaml): per rank, the memory above the weights the model predicts
    against torch's allocated peak above the weights, at every point that ran; the largest batch it predicts at each
    prompt length lies between the largest that ran and the smallest that ran out of memory."""
    import json

    from dsexp.analysis.matrix import build_rows
    from dsexp.analysis.workload_points import largest_batches

    paths = h200_capacity_results()
    assert paths, "no committed H200 capacity run"
    checked = 0
    for path in paths:
        rows = build_rows([json.loads(path.read_text())])
        points = capa.point_rows(rows)
        for q in points:
            if q.status != "ok":
                continue
            for measured, predicted in zip(q.measured, q.predicted):
                assert abs(predicted / measured - 1) <= 0.05, (path.parent.parent.name, q.batch, q.prompt_tokens)
                checked += 1
        for fit in largest_batches(rows, points):
            assert fit.ran is None or fit.predicted >= fit.ran, (path.parent.parent.name, fit)
            assert fit.out_of_memory is None or fit.predicted < fit.out_of_memory, (path.parent.parent.name, fit)
    assert checked >= 14


def test_a_scripts_generate_calls_are_listed_as_facts_beside_the_models_bytes_for_each():
    """The seed's main.py on the H200 (results/h200/scripts/seed20): one generate call per run, through InternLM2's
    chat, 122 prompt tokens and 16 new; the model's bytes above the weights for that call are there, labelled a
    prediction, and the measured figure is the GPU's."""
    from dsexp.analysis.summary import text_sections

    from helpers.run import ROOT

    text = text_sections(ROOT / "results/h200/scripts/seed20")["script_calls"]
    rows = [ln for ln in text.splitlines() if ln.startswith("| `script:main.py")]
    assert len(rows) == 2 and "a prediction" in text
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert cells[3:7] == ["chat", "1", "122", "16"]
        # both below 1 GiB: read in MiB (sections.common.size), never rounded to "0.1x GiB"
        for cell in cells[7:9]:
            value, unit = cell.split()
            assert unit == "MiB" and 100 < float(value) < 1024, cell
    measured = sorted(float(r.split("|")[-2].split()[0]) for r in rows)
    assert measured == [149.51, 208.02]  # rank 0's allocated peak in generate minus its weights, in MiB


@pytest.mark.parametrize("run", ["seed20/0", "seed20/1", "seed20_tp4/0", "seed24/0", "seed24_tp4/0"])
def test_a_scripts_generate_call_on_the_seeds_stack_is_predicted_with_the_packed_qkv_its_cache_keeps(run):
    """The seed's main.py on its stack (transformers 4.42) on the H200, InternLM2 at 20B/24-layer shapes: rank 0's
    allocated peak in the chat's generate above its weights (AutoTP at tp=2 and 4, kernel injection with no policy:
    the whole model). The prompt's cache holds each layer's packed qkv through the value's view (capacity.KEEPS):
    without it the model was 15-41% under (149.51 MiB measured, 110.87 predicted at tp=2)."""
    from dsexp.analysis.matrix import build_rows
    from dsexp.analysis.sections.script_calls import measured_above, predicted_above
    from dsexp.analysis.user_script import generate_calls
    from dsexp.predict import capacity as cap

    from helpers.run import ROOT

    result = json.loads((ROOT / "results/h200/scripts" / run / "result.json").read_text())
    (row,) = build_rows([result])
    (call,) = generate_calls(row.result)
    predicted, measured = predicted_above(row, call), measured_above(row, call)
    assert abs(predicted / measured - 1) <= 0.03, (run, predicted, measured)
    assert row.prediction.strategy.transformers == "4.42.4"
    today = dataclasses.replace(row.prediction.strategy, transformers="5.24.0")  # copies the value: no qkv kept
    assert not cap.pins_packed_qkv(cap.Shapes.of(row.prediction.dims), today)


def test_an_out_of_memory_with_room_left_under_the_cap_is_named_as_fragmentation():
    """The H200 at 40 GiB (results/h200/budget/gpu40, job 3): batch 13 failed asking 4.88 GiB with 29.51 GiB
    allocated and 39.34 GiB allowed: 7.90 GiB sat reserved but unallocated. The report says fragmentation failed it,
    not the total, and how to change the allocator; an error without room left is not called that."""
    import json

    from dsexp.analysis.summary import text_sections

    from helpers.run import ROOT

    record = json.loads((ROOT / "results/h200/budget/gpu40/3/result.json").read_text())
    f = capa.fragmentation(record["ranks"][0]["points"][0]["error"]["message"])
    assert f is not None and round(f.needed / GIB, 2) == 34.39 and round(f.unallocated / GIB, 2) == 7.90
    full = "Tried to allocate 6.00 GiB. 39.34 GiB allowed; Of the allocated memory 35.00 GiB is allocated by PyTorch, "
    assert capa.fragmentation(full + "and 1.00 GiB is reserved by PyTorch but unallocated.") is None
    assert capa.fragmentation("CUDA out of memory. Tried to allocate 2.00 MiB") is None  # no cap, no split: unknown
    text = text_sections(ROOT / "results/h200/budget/gpu40")["capacity"]  # the report's section, no plot drawn
    assert "Batch 13 x 2048" in text and "ran out of memory with room left" in text
    assert "7.90 GiB sat reserved but unallocated" in text and "+trim.env.PYTORCH_CUDA_ALLOC_CONF" in text


def test_a_model_line_of_one_point_is_drawn_and_no_out_of_memory_entry_without_one(tmp_path, monkeypatch):
    """A configuration measured at one point has a model "line" of one point, which matplotlib draws as nothing: it
    gets a dash, so the legend's memory-model entry names something on the plot; the out-of-memory entry is there
    only where a point ran out."""
    import matplotlib.pyplot as plt

    from dsexp.analysis import plots

    monkeypatch.setattr(plt, "close", lambda fig: None)  # keep the figure to look at
    one = {("a", 1): {"measured": [(512, 0.3)], "oom": [], "predicted L=512": [(512, 0.31)]}}
    plots.memory_vs_tokens(one, True, tmp_path / "one.png")
    ax = plt.gcf().axes[0]
    assert any(line.get_marker() == "_" and len(line.get_xdata()) == 1 for line in ax.lines)
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "memory model, L=512" in labels and not any("out of memory" in t for t in labels)
    plt.close("all")
