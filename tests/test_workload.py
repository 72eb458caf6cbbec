"""The workload's shape as config: the grid one job runs, its phase names and metrics, the latency summaries, and
what validation refuses before anything launches (compose only, nothing run)."""

from __future__ import annotations

import pytest

from dsexp.analysis.labels import workload_label
from dsexp.core.records import metric_name, phase_kind, phase_quantities
from dsexp.core.schema import ConfigError
from dsexp.core.workload import Point, dominated, grid, parse_phase, percentile, summary

from helpers.run import spec_of


def test_a_grid_runs_in_ascending_length_then_batch_without_duplicates():
    points = grid({"batch_size": [8, 1, 8], "prompt_tokens": [2048, 512]})
    assert points == [Point(1, 512), Point(8, 512), Point(1, 2048), Point(8, 2048)]
    assert [p.phase(single=False) for p in points][:2] == ["generate[b=1,l=512]", "generate[b=8,l=512]"]
    assert grid({"batch_size": 1, "prompt_tokens": None}) == [Point(1, None)]
    assert Point(1, None).phase(single=True) == "generate"  # a single point keeps the phase every report reads


def test_point_phases_are_generate_phases_with_metric_safe_names():
    key = "generate[b=8,l=2048]"
    assert phase_kind(key) == "generate"
    assert parse_phase(key) == Point(8, 2048)
    assert parse_phase("generate_2") is None
    assert metric_name(key) == "generate_b8_l2048"  # MLflow refuses brackets, commas and '=' in metric names


def test_a_point_that_ran_out_of_memory_dominates_only_points_as_large_in_both():
    oom = [Point(8, 1024)]
    assert dominated(Point(16, 1024), oom) == Point(8, 1024)
    assert dominated(Point(8, 2048), oom) == Point(8, 1024)
    assert dominated(Point(4, 2048), oom) is None  # fewer sequences may fit at a longer prompt
    assert dominated(Point(16, 512), oom) is None


def test_percentiles_interpolate_as_numpy_does():
    vals = [1.0, 2.0, 3.0, 4.0, 10.0]
    assert percentile(vals, 50) == 3.0
    assert percentile(vals, 90) == pytest.approx(7.6)  # numpy.percentile(vals, 90)
    assert percentile(vals, 99) == pytest.approx(9.76)
    s = summary([0.5])
    assert s["p50"] == s["p99"] == 0.5 and s["n"] == 1


def test_point_figures_become_metrics():
    phase = {
        "wall_s": 1.0,
        "point": {
            "prefill": {"gpu_alloc_peak": 2**30},
            "decode": {"host_rss_peak": 2**31},
            "kv_cache_bytes": 2**29,
            "latency": {"ttft": {"p50": 0.1, "p90": 0.2}, "tpot": {"p50": 0.01}, "tokens_per_s": 50.0},
        },
    }
    q = phase_quantities(phase)
    assert q["prefill_gpu_alloc_peak_gib"] == 1.0 and q["decode_host_rss_peak_gib"] == 2.0
    assert q["kv_cache_gib"] == 0.5 and q["ttft_p90_s"] == 0.2 and q["tokens_per_s"] == 50.0


def test_the_workload_shape_is_part_of_a_configuration_only_where_set():
    assert workload_label({"generate": {"batch_size": 1, "prompt_tokens": None}}) is None
    assert workload_label({"generate": {"batch_size": 8, "prompt_tokens": 2048}}) == "b8xL2048"
    assert workload_label({"generate": {"batch_size": [1, 8], "prompt_tokens": [512]}}) == "b[1,8]xL[512]"


def test_batch_and_context_are_sweep_dimensions():
    """`-m generate.batch_size=1,8 generate.prompt_tokens=64,128` is four jobs; a list is one job's grid."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(["generate.batch_size=1,8", "generate.prompt_tokens=64,128"])
    jobs = BasicSweeper.split_arguments(parsed, None)[0]
    specs = [spec_of(*job) for job in jobs]
    assert sorted((s.generate.batch_size, s.generate.prompt_tokens) for s in specs) == [
        (1, 64),
        (1, 128),
        (8, 64),
        (8, 128),
    ]
    grid_spec = spec_of("generate.batch_size=[1,8]", "generate.prompt_tokens=[64,128]")
    assert len(grid(grid_spec.generate)) == 4


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["generate.batch_size=0"], "generate.batch_size=0: must be >= 1"),
        (["generate.batch_size=[1,0]"], "generate.batch_size=0: must be >= 1"),
        (["generate.prompt_tokens=-4"], "generate.prompt_tokens=-4: must be >= 1"),
        (["generate.new_tokens=-1"], "generate.new_tokens=-1: must be >= 1"),
        (["generate.repeats=0"], "generate.repeats=0"),
        (["generate.warmup=-1"], "generate.warmup=-1"),
        (["generate.batch_size=[]"], "generate.batch_size=[]"),
        (["generate.batch_size=1.5"], "must be a whole number"),
        # tiny's max_position_embeddings is 512: both numbers are named
        (
            ["generate.prompt_tokens=[64,500]", "generate.new_tokens=16"],
            "= 516 tokens, past model=tiny's max_position_embeddings=512",
        ),
    ],
)
def test_a_shape_that_cannot_run_is_refused_before_launch(overrides, needle):
    with pytest.raises(ConfigError) as e:
        spec_of(*overrides)
    assert needle in str(e.value)


def test_kernel_injection_past_max_out_tokens_is_refused_naming_both():
    with pytest.raises(ConfigError) as e:
        spec_of("engine.kernel_inject=true", "generate.prompt_tokens=1020", "generate.new_tokens=8", gpus=1)
    assert "= 1028 tokens, past engine.max_out_tokens=1024" in str(e.value)


def test_the_headline_peaks_count_a_grids_points():
    from dsexp.core.records import aggregate_metrics, headline

    point = {"latency": {"tokens_per_s": 40.0}}
    rank = {
        "rank": 0,
        "phases": {
            "load": {"wall_s": 1.0, "peaks": {"host_rss_peak": 2**30}},
            "generate[b=8,l=64]": {"wall_s": 2.0, "peaks": {"host_rss_peak": 3 * 2**30}, "point": point},
        },
    }
    h = headline(aggregate_metrics([rank]), [rank], new_tokens=4)
    assert h["host_peak_gib"] == 3.0 and h["tokens_per_s"] == 40.0


def test_a_tpot_is_never_shown_negative():
    """TTFT and e2e from the same call give TPOT >= 0; an older record whose TTFT came from other calls (a prefill
    over gloo once took longer than another call's whole run: -211 ms on the H200) shows no TPOT, and says why."""
    from dsexp.analysis.sections.latency import TPOT_UNKNOWN, percentiles, tpot_cell
    from dsexp.rank.generation import latency

    lat = latency([0.5, 0.6], [1.0, 1.2], batch=2, new_tokens=3, prompt_len=8)
    assert lat["tpot"]["min"] == pytest.approx(0.25) and lat["tpot"]["max"] == pytest.approx(0.3)
    assert tpot_cell(lat) == percentiles(lat["tpot"])
    older = {"ttft": summary([69.26]), "e2e": summary([67.78]), "tpot": summary([(67.78 - 69.26) / 7])}
    assert tpot_cell(older) == TPOT_UNKNOWN


def test_a_call_without_a_first_token_stamp_has_no_ttft_rather_than_a_made_up_one():
    """An engine whose generate never calls the logits processors leaves no first-token stamp: that call has no TTFT
    and no TPOT (not TTFT = e2e and TPOT = 0); its e2e and tokens/s still count."""
    from dsexp.rank.generation import latency

    lat = latency([None, 0.4], [1.0, 1.0], batch=1, new_tokens=3, prompt_len=8)
    assert lat["ttft"]["n"] == lat["tpot"]["n"] == 1 and lat["e2e"]["n"] == 2 and lat["ttft_s"] == [None, 0.4]
    assert lat["tpot"]["p50"] == pytest.approx(0.3) and lat["tokens_per_s"] == pytest.approx(3.0)
    none = latency([None], [1.0], batch=1, new_tokens=3, prompt_len=8)
    assert none["ttft"] == none["tpot"] == {"n": 0} and none["prefill_tokens_per_s"] is None


def test_the_first_sequence_alone_gives_the_logits_the_whole_batch_gives_it():
    """The correctness check's logits call runs the first sequence of a point alone (core.workload.CHECK_BATCH): the
    point's sequences are one prompt repeated, so its first-step logits are the batch's first row's, to float
    rounding; at the point's batch that call raised a search's first point's reserved peak above its others'."""
    import torch
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsexp.core.workload import CHECK_BATCH
    from dsexp.rank.generation import call_generate, first_logits

    from helpers.run import ROOT

    dims = yaml.safe_load((ROOT / "conf" / "model" / "tiny_llama.yaml").read_text())["dims"]
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**dims)).eval()
    inp = torch.tensor([[5, 9, 2, 7, 3, 11, 4, 8]] * 4)
    alone = first_logits(call_generate(model, inp[:CHECK_BATCH], 1, {}, output_logits=True))
    batch = first_logits(call_generate(model, inp, 1, {}, output_logits=True))
    assert CHECK_BATCH == 1 and alone.shape == batch.shape == (dims["vocab_size"],)
    assert torch.allclose(alone, batch, rtol=1e-5, atol=1e-5) and alone.abs().max() > 0
