"""`python -m dsexp.plan`: every configuration predicted from its config alone, by the same function the report
and the budget search call (dsexp.predict.job.predict), without a GPU, a rank or a weight."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsexp.analysis.memory import predict as report_prediction
from dsexp.predict import capacity as cap
from dsexp.predict.job import workloads_of

from helpers.plan import plan
from helpers.run import sweep_results

# A Llama as its config.json says it, at a size no preset has (a 3B-class model: 26 layers, GQA 4:1)
LLAMA_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 3072,
    "intermediate_size": 8192,
    "num_hidden_layers": 26,
    "num_attention_heads": 24,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "max_position_embeddings": 8192,
    "torch_dtype": "bfloat16",
}


def config_folder(tmp_path: Path, **changes) -> Path:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    cfg = {k: v for k, v in {**LLAMA_CONFIG, **changes}.items() if v is not None}
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_the_plan_of_a_run_reaches_the_reports_prediction_from_the_config_alone(
    tiny_sweep, capsys, tmp_path, cache_dir, monkeypatch
):
    """The session's tiny sweep (tp=1,2, CPU) ran; the plan of the same overrides, from the config alone, says what the
    report says of each run: weights, reserve, KV cache, host per rank, and every term above the weights. Both are
    dsexp.predict's figures, the plan's from the composed overrides and the report's from the result.json, so this
    holds that the plan composes what the run ran (configuration, workload, model facts), not that the terms are
    right: those are checked against the H200's measurements in tests/test_capacity_report.py."""
    monkeypatch.setenv("DSEXP_CACHE", str(cache_dir))  # the plan finds the checkpoint the run wrote (its file sizes)
    status, entries, _, _ = plan(capsys, tmp_path, "-m", "tp=1,2", "load=eager", "model=tiny", "device=cpu")
    assert status == 0
    by_tp = {e["tp"]: e for e in entries}
    results = sweep_results(tiny_sweep[1])
    assert sorted(by_tp) == sorted(r["config"]["tp"] for r in results) == [1, 2]
    for result in results:
        entry, pred = by_tp[result["config"]["tp"]], report_prediction(result)
        [w] = workloads_of(result["config"])
        terms = cap.above_weights(pred.dims, pred.strategy, pred.tp, w)
        for r, rank in enumerate(entry["per_rank"]):
            assert rank["weights_bytes"] == pred.weights[r] and rank["reserve_bytes"] == pred.weights[r]  # CPU
            assert (rank["host_private_bytes"], rank["host_mapped_bytes"]) == (pred.host.anon[r], pred.host.file[r])
            point = rank["points"][0]
            assert (point["batch"], point["prompt_tokens"], point["new_tokens"]) == (
                w.batch,
                w.prompt_tokens,
                w.new_tokens,
            )
            assert {k: v[r] for k, v in terms.items()} == {k: point[f"{k}_bytes"] for k in terms}
            assert point["above_weights_bytes"] == sum(v[r] for v in terms.values()) > 0


def test_a_folder_holding_only_config_json_is_planned_with_its_largest_batch_on_a_named_card(capsys, tmp_path):
    folder = config_folder(tmp_path)
    status, [entry], text, _ = plan(
        capsys, tmp_path, "model=local", f"model.path={folder}", "tp=2", "gpu=a100_40gb",
        "generate.prompt_tokens=[512,2048]",
    )  # fmt: skip
    assert status == 0 and entry["status"] == "predicted" and entry["device"] == "cuda"
    params = 32000 * 3072 * 2 + 26 * (3072 * 3072 * 2 + 2 * 3072 * 1024 + 3 * 3072 * 8192 + 2 * 3072) + 3072
    assert 0 <= entry["model_bytes"] - 2 * params <= 1024  # bf16 parameters, from the config alone; + RoPE's inv_freq
    ranks = entry["per_rank"]
    assert ranks[0]["weights_sharded_bytes"] + ranks[0]["weights_replicated_bytes"] == ranks[0]["weights_bytes"]
    assert ranks[0]["weights_bytes"] < entry["model_bytes"] * 0.6  # AutoTP halves the layers
    assert ranks[0]["cuda_context_bytes"] > 0 and ranks[0]["communicator_bytes"] > 0  # NCCL between 2 GPUs
    fits = entry["largest_batch"]
    assert set(fits) == {"512", "2048"} and fits["512"]["largest_batch"] > fits["2048"]["largest_batch"] > 0
    assert entry["gpu_budget_bytes"] == int(39.39 * 2**30)
    for point in ranks[0]["points"]:
        assert point["peak_bytes"] > point["above_weights_bytes"] + ranks[0]["reserve_bytes"]
    assert "largest batch on a 39.39 GiB GPU" in text and "L=2048" in text


def test_a_sweep_over_tp_load_and_trim_is_planned_configuration_by_configuration(capsys, tmp_path):
    status, entries, text, _ = plan(
        capsys, tmp_path, "-m", "model=tiny", "tp=1,2", "load=eager,meta,sharded", "trim=none,all", "budget.gpu_gib=1"
    )
    assert status == 0 and len(entries) == 12 and all(e["status"] == "predicted" for e in entries)
    assert len({tuple(e["overrides"]) for e in entries}) == 12
    host = {(e["tp"], e["load"]): e["host"]["node_private_bytes"] for e in entries}
    tp2 = [e for e in entries if e["tp"] == 2]
    trimmed = {(e["load"], "trim=all" in e["overrides"]): max(r["weights_bytes"] for r in e["per_rank"]) for e in tp2}
    assert trimmed[("eager", True)] < trimmed[("eager", False)]  # the trims shard the head and embedding
    assert host[(2, "meta")] >= 0 and "all configurations" in text


def test_without_m_a_sweep_is_refused_as_hydra_refuses_it(capsys, tmp_path):
    status, entries, _, err = plan(capsys, tmp_path, "tp=1,2")
    assert status == 2 and not entries and "tp=1,2" in err and "-m" in err


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["model=config", "model.arch=lama"], "'lama' is neither a dsexp preset"),
        (["tp=3", "model=tiny", "engine=hf_tp"], "tp=3 must divide the model's"),
        (["model=tiny", "generate.batch_size=abc"], "generate.batch_size='abc': must be a whole number"),
        (["model=tiny", "gpu=h100"], "choose one of: a100_40gb"),
        (
            ["model=config", "model.arch=mistral", "model.dims={hidden_size: 128}"],
            "model.dims is not in the composed config: add it with a leading +, as '+model.dims=...'",
        ),
        (
            ["model=config", "model.arch=llama", "+model.dims={tie_word_embeddings: true}"],
            "model.dims.tie_word_embeddings=True clashes with the preset model.arch=llama, which sets",
        ),
    ],
)
def test_bad_input_is_refused_with_the_key_and_what_is_accepted(capsys, tmp_path, overrides, needle):
    status, entries, _, err = plan(capsys, tmp_path, *overrides)
    assert status == 2 and not entries and needle in err, err


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"model_type": "llamma"}, "model_type='llamma' is not one of transformers'"),
        ({"hidden_size": None}, "has no hidden_size: the memory model needs"),
    ],
)
def test_a_config_json_the_model_cannot_read_is_refused_naming_the_key(capsys, tmp_path, changes, needle):
    folder = config_folder(tmp_path, **changes)
    status, entries, _, err = plan(capsys, tmp_path, "model=local", f"model.path={folder}")
    assert status == 2 and not entries and needle in err, err


def test_a_configuration_the_model_has_no_rule_for_is_listed_and_the_others_predicted(capsys, tmp_path):
    """InternLM2 under kernel injection: DeepSpeed has no policy and AutoTP refuses it without one (its own assert):
    that configuration says why, the other is predicted."""
    status, entries, text, _ = plan(
        capsys, tmp_path, "-m", "model=internlm2_tiny", "engine.injection_policy=null,infer", "tp=2"
    )
    assert status == 1  # a configuration not predicted: the plan says which and why, and fails
    by = {e["status"]: e for e in entries}
    assert set(by) == {"predicted", "not_predicted"} and by["not_predicted"]["reason"]
    assert "not predicted:" in text


def test_replay_gives_the_allocators_answer_beside_the_allocated_bytes_one_where_it_can(capsys, tmp_path):
    status, entries, text, _ = plan(
        capsys,
        tmp_path,
        "--replay",
        "-m",
        "model=tiny",
        "tp=1",
        "engine.kernel_inject=false,true",
        "budget.gpu_gib=0.75",
        "generate.prompt_tokens=256",
        "generate.new_tokens=2",
    )
    assert status == 0
    by_kernels = {e["overrides"][0].lower(): e["largest_batch"]["256"] for e in entries}
    fit = by_kernels["engine.kernel_inject=false"]
    one = fit["replayed"]
    assert 0 < one["default"]["batch"] <= fit["allocated_bytes_bound"]  # fragmentation only lowers it
    assert fit["largest_batch"] == one["default"]["batch"] and fit["answer_from"] == "replay:default"  # the answer
    assert by_kernels["engine.kernel_inject=true"]["answer_from"] == "allocated_bytes_bound"  # not replayed
    assert one["expandable_segments"]["batch"] > 0  # (20 MiB pages: at a 72 MiB cap not always more)
    assert "kernel injection" in by_kernels["engine.kernel_inject=true"]["replayed"]["not_replayed"]
    assert "replayed through the caching allocator" in text
    import transformers

    assert one["traced_with"] == f"transformers {transformers.__version__}"  # the trace depends on it
    assert f"generate traced with transformers {transformers.__version__}" in text


def test_the_replay_fails_in_generate_for_the_architectures_whose_autotp_runs_failed_there_and_no_other(
    capsys, tmp_path
):
    """The CPU architecture matrix's AutoTP runs at tp=2 (tests/data/arch_matrix_census.json, every one that got
    through init): the plan's replay, traced on the meta device as rank 0 holds the model, fails in generate where
    the run failed in generate and replays where the run was ok. The bytes' answer stands either way."""
    census = json.loads((Path(__file__).parent / "data" / "arch_matrix_census.json").read_text())
    runs = {r["config"]["model"]["name"]: r for r in census if r["config"]["engine"]["name"] == "init_inference"}
    failed = {name for name, r in runs.items() if r["status"] != "ok"}
    assert failed and len(failed) < len(runs)  # both outcomes are held to the replay
    assert all(rk["error"]["phase"] == "generate" for name in failed for rk in runs[name]["ranks"])
    status, entries, text, err = plan(
        capsys, tmp_path, "--replay", "-m", f"model={','.join(sorted(runs))}", "tp=2", "gpu=a100_40gb",
        "engine.injection_policy=infer", "generate.new_tokens=2",
    )  # fmt: skip
    assert status == 0, err
    assert {e["model"] for e in entries} == set(runs) and all(e["status"] == "predicted" for e in entries)
    for e in entries:
        (fit,) = e["largest_batch"].values()
        why = fit["replayed"].get("not_replayed", "")
        assert why.startswith("its generate fails as rank 0 holds the model") == (e["model"] in failed), (e, why)
        assert fit["largest_batch"] > 0  # the allocated bytes' answer, replayed or not
    assert "a run is expected to fail there too" in text


def test_at_a_tp_that_does_not_divide_the_kv_heads_each_ranks_attention_is_told_the_heads_its_weights_hold(
    capsys, tmp_path
):
    """InternLM2 (tiny: 8 heads, 4 KV heads) at tp=3: DeepSpeed's AutoTP gives the ranks 2, 1 and 1 KV heads and
    shares the module attributes out the same way (update_mp_params: get_shard_size by KV heads), so its run is ok
    and correct on the CPU. The rank model the replay traces holds the same: each attention's counts match its
    wqkv and wo, and the generate replays (an even split of the counts, 3 / 3 / 2 heads, failed in the attention)."""
    from dsexp.compose.budget.model import predict_spec, script_config
    from dsexp.engines.placement import RULES
    from dsexp.predict import architecture as arch

    from helpers.run import spec_of

    spec = spec_of("model=internlm2_tiny", "tp=3", "device=cuda", gpus=3)
    pred = predict_spec(spec)
    model = arch.meta_model(arch.model_source(script_config(spec), None), pred.strategy.dtype)
    kv_heads = []
    for rank in range(3):
        ranked, _ = RULES.rank_model(model, pred.strategy, pred.placements, rank, 3)
        att = dict(ranked.named_modules())["model.layers.0.attention"]
        groups = att.num_heads // att.num_key_value_heads
        assert att.wqkv.weight.shape[0] == (groups + 2) * att.num_key_value_heads * att.head_dim
        assert att.wo.weight.shape[1] == att.num_heads * att.head_dim == att.hidden_size
        kv_heads.append(att.num_key_value_heads)
    assert kv_heads == [2, 1, 1]
    status, entries, _, err = plan(capsys, tmp_path, "--replay", "model=internlm2_tiny", "tp=3", "gpu=a100_40gb",
                                   "generate.new_tokens=2")  # fmt: skip
    assert status == 0, err
    ((fit,),) = [list(e["largest_batch"].values()) for e in entries]
    assert fit["replayed"]["default"]["batch"] > 0, fit["replayed"]


def test_a_replay_traced_under_another_transformers_than_the_stack_pins_says_so():
    from dsexp.analysis.sections.plan_table import replayed_text
    from dsexp.predict.job import installed, traced_with

    here = installed("transformers")
    assert traced_with({}) == {"traced_with": f"transformers {here}"}  # the ranks run this environment's
    assert "version_note" not in traced_with({"stack": {"transformers": here}})
    pinned = traced_with({"stack": {"name": "seed", "transformers": "4.42.4"}})
    assert "the stack runs 4.42.4" in pinned["version_note"]
    assert "the trace needs transformers 5" in pinned["version_note"]  # no flag that would not work
    newer = traced_with({"stack": {"transformers": "5.17.0"}})
    assert "--trace-in-stack replays under 5.17.0" in newer["version_note"]  # how to get the stack's own answer
    r = {**pinned, "default": {"batch": 5}, "expandable_segments": {"batch": 6}}
    assert replayed_text(r, "bound 7").endswith(pinned["version_note"] + "]")


@pytest.mark.network  # the other transformers' overlay, from the package index
def test_trace_in_stack_replays_each_configuration_under_the_transformers_its_stack_pins(capsys, tmp_path, cache_dir):
    """A stack pinning another transformers is planned in its overlay (prepared as a sweep prepares it: the package
    index the first time); one pinning this environment's is planned here. Each keeps its own label."""
    from dsexp.predict.job import installed

    here = installed("transformers")
    other = "5.17.0" if here != "5.17.0" else "5.24.0"
    common = ["model=tiny_llama", "gpu=a100_40gb", f"cache_dir={cache_dir}", "generate.prompt_tokens=64"]
    status, entries, text, err = plan(
        capsys, tmp_path, "--replay", "--trace-in-stack", "-m", *common, f"stack.transformers={other},{here}"
    )
    assert status == 0, err
    by_version = {e["overrides"][0].split("=")[1]: e for e in entries}
    assert set(by_version) == {other, here}
    (away,) = by_version[other]["largest_batch"].values()
    (home,) = by_version[here]["largest_batch"].values()
    assert away["replayed"]["traced_with"] == f"transformers {other}" and "version_note" not in away["replayed"]
    assert by_version[other]["in_stack"] and "in_stack" not in by_version[here]
    assert home["replayed"]["traced_with"] == f"transformers {here}" and "version_note" not in home["replayed"]
    assert by_version[other]["configuration"] == f"stack.transformers={other}"
    assert f"generate traced with transformers {other}" in text


def test_a_stack_that_cannot_be_prepared_is_an_entry_saying_why_and_the_plan_goes_on(capsys, tmp_path, cache_dir):
    common = ["model=tiny_llama", "gpu=a100_40gb", f"cache_dir={cache_dir}", "generate.prompt_tokens=64"]
    status, entries, _, err = plan(
        capsys, tmp_path, "--replay", "--trace-in-stack", *common, "stack.transformers=0.0.1"
    )
    assert status == 1 and "dsexp.plan: not predicted: (as composed)" in err
    (entry,) = entries
    assert entry["status"] == "not_predicted"
    assert entry["reason"].startswith("its stack could not be prepared") and "transformers==0.0.1" in entry["reason"]


def test_trace_in_stack_without_replay_is_refused_before_anything_is_planned(capsys, tmp_path):
    with pytest.raises(SystemExit) as stopped:
        plan(capsys, tmp_path, "--no-replay", "--trace-in-stack", "model=tiny_llama", "stack.transformers=5.17.0")
    assert stopped.value.code == 2
    assert "--trace-in-stack traces the replay's generate: drop --no-replay" in capsys.readouterr().err


def test_the_plans_multirun_flag_may_come_after_the_overrides():
    """`python -m dsexp.plan quant=int4_weight gpu=h100_80gb -m tp=1,2`: -m among the overrides (argparse stopped at
    it and called tp=1,2 an unrecognized argument)."""
    from dsexp.compose.planning import parse_args

    args = parse_args(["model=tiny", "-m", "tp=1,2", "--no-replay"])
    assert args.multirun and args.overrides == ["model=tiny", "tp=1,2"] and not args.replay
