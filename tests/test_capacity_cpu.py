"""One job on the CPU (tp=2) running a workload grid: the model loads once and each point is its own phase; a point
that runs out of memory (simulated: fault kind=oom) is a result recorded with its allocator state while the other
points go on; the KV cache each rank measured equals the memory model's term."""

from __future__ import annotations

import pytest

from dsexp.core.workload import Point, parse_phase
from dsexp.predict import capacity as cap

from helpers.run import run_dsexp, sweep_results

NEW = 3
pytestmark = pytest.mark.timeout(1200)


@pytest.fixture(scope="module")
def grid_job(tmp_path_factory, cache_dir):
    cwd = tmp_path_factory.mktemp("grid")
    run_dsexp(
        [
            "-m",
            "tp=2",
            "debug=fault",
            "fault={kind:oom,at_tokens:40}",
            "check.correctness=false",
            "probe.sample_ms=0",
            "generate.batch_size=[1,2,4]",
            "generate.prompt_tokens=[8,16,24]",
            f"generate.new_tokens={NEW}",
            "generate.repeats=2",
            "generate.warmup=1",
            "tracking=none",  # read from result.json and the report
            "hydra.sweep.dir=multirun/grid",
        ],
        cwd,
        cache_dir,
    )
    (result,) = sweep_results(cwd / "multirun" / "grid")
    result["_sweep_dir"] = str(cwd / "multirun" / "grid")
    return result


def test_a_grid_loads_once_and_runs_each_point_as_its_own_phase(grid_job):
    assert grid_job["status"] == "ok", grid_job.get("failure")
    for rank in grid_job["ranks"]:
        kinds = [e["kind"] for e in rank["timeline"]]
        assert kinds.count("load") == 1 and kinds.count("init") == 1
        points = [parse_phase(e["phase"]) for e in rank["timeline"] if e["kind"] == "generate"]
        assert points == [
            Point(1, 8),
            Point(2, 8),
            Point(4, 8),
            Point(1, 16),
            Point(2, 16),
            Point(4, 16),
            Point(1, 24),
            Point(2, 24),
        ]  # (4, 24) is skipped: larger than (2, 24), which ran out
    assert "generate_b1_l8.ttft_p50_s.max" in grid_job["metrics"]


def test_an_out_of_memory_point_is_a_result_and_the_other_points_go_on(grid_job):
    for rank in grid_job["ranks"]:
        status = {(p["batch"], p["prompt_tokens"]): p["status"] for p in rank["points"]}
        assert status[(4, 16)] == status[(2, 24)] == "oom"  # 64 and 48 tokens >= 40
        assert status[(1, 24)] == "ok"  # after the first point that ran out
        assert status[(4, 24)] == "skipped"
        oom = next(p for p in rank["points"] if p["status"] == "oom")
        assert oom["oom_ranks"] == [0, 1] and oom["error"]["type"] == "OutOfMemoryError"
        assert oom["error"]["allocator"]["host_rss"] > 0
        phase = rank["phases"]["generate[b=4,l=16]"]
        assert phase["point"]["out_of_memory"]["message"].startswith("dsexp fault injection")
        assert rank["status"] == "ok" and rank["error"] is None


def test_latency_is_measured_as_the_benchmarks_measure_it(grid_job):
    point = grid_job["ranks"][0]["phases"]["generate[b=2,l=16]"]["point"]
    lat = point["latency"]
    assert len(lat["ttft_s"]) == len(lat["e2e_s"]) == 2  # generate.repeats, after the warm-up
    # the call that gives the logits runs at the grid's first point only (the others' went unread), of its first
    # sequence alone
    phases = grid_job["ranks"][0]["phases"]
    assert phases["generate[b=1,l=8]"]["point"]["logits_call"]["batch"] == 1
    later = [ph.get("point") or {} for k, ph in phases.items() if k.startswith("generate[") and "b=1,l=8" not in k]
    assert later and all("logits_call" not in p for p in later)
    # TTFT and e2e come from the same call, so TPOT is never negative (two calls' times subtracted once gave -211 ms
    # on the H200 over gloo)
    assert all(0 < f < t for f, t in zip(lat["ttft_s"], lat["e2e_s"]))
    assert lat["tpot"]["n"] == 2 and lat["tpot"]["min"] > 0
    assert lat["tpot"]["mean"] == pytest.approx(
        sum((t - f) / (NEW - 1) for f, t in zip(lat["ttft_s"], lat["e2e_s"])) / 2
    )
    assert lat["ttft"]["n"] == lat["e2e"]["n"] == 2
    assert lat["ttft"]["min"] == min(lat["ttft_s"]) and lat["e2e"]["max"] == max(lat["e2e_s"])
    assert lat["tokens_per_s"] == pytest.approx(2 * NEW * 2 / sum(lat["e2e_s"]))
    assert point["tokens_produced"] == 2 * NEW
    assert point["prefill"]["host_rss_peak"] > 0 and point["decode"]["host_rss_peak"] > 0


def test_the_kv_cache_each_rank_measured_is_the_models_term(grid_job):
    dims = grid_job["config"]["model"]["dims"]  # tiny: 2 layers, 8 heads, 4 KV heads (2 per rank), hidden 256
    heads = dims["num_attention_heads"]
    shapes = cap.Shapes(
        dims["num_hidden_layers"],
        dims["hidden_size"],
        dims["intermediate_size"],
        heads,
        dims["num_key_value_heads"],
        dims["hidden_size"] // heads,
        dims["vocab_size"],
    )
    strategy = type("S", (), {"splits_weights": True})()
    for rank in grid_job["ranks"]:
        held = cap.rank_heads(shapes, strategy, 2, rank["rank"])
        for key, phase in rank["phases"].items():
            point = phase.get("point") or {}
            if "kv_cache_bytes" not in point:
                continue
            tokens = point["prompt_tokens"] + NEW - 1  # the last token is never fed back
            exact = 2 * shapes.layers * held["kv_heads"] * shapes.head_dim * tokens * point["batch"] * 2  # bf16
            assert point["kv_cache_bytes"] == exact, key
            term = cap.kv_cache(shapes, held["kv_heads"], point["batch"], tokens, 2)
            assert exact <= term < exact + 2 * shapes.layers * 512  # the allocator's 512-byte rounding per tensor


def test_the_report_shows_each_point_measured_against_the_model(grid_job, tmp_path):
    from pathlib import Path

    from dsexp.analysis.summary import write_report

    parts = write_report(Path(grid_job["_sweep_dir"]), out_dir=tmp_path)
    table = parts["capacity"]
    assert "| 4 | 16 | 64 | oom |" in table and "| 4 | 24 | 96 | skipped |" in table
    ok_rows = [line for line in table.splitlines() if "| ok |" in line]
    assert len(ok_rows) == 6  # every point that ran, its KV cache measured against the model's term
    # on the CPU the tensors' own bytes on both sides (no caching allocator rounds them): the model is exact
    assert all("| 1.000 |" in row for row in ok_rows), ok_rows
    assert "TTFT" in parts["latency"] and "| 2 | 16 |" in parts["latency"]
    assert (tmp_path / "plots" / "memory_vs_tokens.png").stat().st_size > 0
    assert (tmp_path / "plots" / "latency_vs_batch.png").stat().st_size > 0
