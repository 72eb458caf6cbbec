"""Engines on CPU (gloo, tp=2) with the InternLM2-layout tiny model, the seed preset, and how failures are classed.

End to end through `python -m dsexp`: what each engine did (module classes replaced, weight fraction
per rank, what stayed replicated, config fields never read) is read back from result.json.
"""

from __future__ import annotations

import traceback

import pytest

from dsexp.core.schema import ConfigError
from dsexp.job.failures import classify

from helpers.run import run_dsexp, spec_of, sweep_results

# The multirun fixtures run several jobs of 2 ranks each; on a busy 2-core machine their setup alone can pass
# the default per-test timeout.
pytestmark = pytest.mark.timeout(1800)


def by_name(results, key):
    return {key(r): r for r in results}


# ---- configuration -------------------------------------------------------------------------------------


def test_kernel_inject_on_cpu_refused_only_where_deepspeed_has_a_kernel_policy():
    with pytest.raises(ConfigError, match="engine.kernel_inject=true on device=cpu.*LlamaDecoderLayer"):
        spec_of("model=tiny", "engine.kernel_inject=true")
    # no DeepSpeed policy matches InternLM2DecoderLayer: injection is a no-op and runs on CPU (the seed's case)
    assert spec_of("model=internlm2_tiny", "engine.kernel_inject=true").engine.kernel_inject


def test_kernel_policy_list_is_deepspeeds():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from dsexp.models.kernel_policy import kernel_injected_layers, kernel_policy_classes
    from dsexp.models.writer import meta_model

    assert LlamaDecoderLayer in kernel_policy_classes()
    assert kernel_injected_layers(meta_model("llama", {"num_hidden_layers": 1}, "bf16")[1]) == ["LlamaDecoderLayer"]
    assert kernel_injected_layers(meta_model("internlm2", {"num_hidden_layers": 1}, "bf16")[1]) == []


def test_seed_preset_is_the_seeds_call():
    s = spec_of("experiment=seed_issue", "tp=2")
    assert (s.model.arch, s.model.trust_remote_code, s.load.name, s.dtype) == ("internlm2", True, "eager", "bf16")
    assert (s.engine.name, s.engine.kernel_inject, s.engine.replace_method, s.engine.max_out_tokens) == (
        "init_inference",
        True,
        "auto",
        1024,
    )
    assert s.zero.stage == 3 and s.zero.extra == {
        "model_persistence_threshold": 0,
        "max_live_parameters": 0,
        "mics_shard_size": 2,
    }
    assert "mics_shard_size" not in spec_of("experiment=seed_issue_accepted", "tp=2").zero.extra
    assert spec_of("experiment=seed_issue", "model=internlm2_20b_shapes").model.dims["hidden_size"] == 6144


def test_zero3_engines_need_a_stage3_block():
    for engine in ("zero_inference", "autotp_zero3"):
        with pytest.raises(ConfigError, match=f"engine={engine} runs ZeRO stage 3"):
            spec_of(f"engine={engine}", "zero=none")
        assert spec_of(f"engine={engine}", "zero=stage3_offload").zero.offload == "cpu"


# ---- failure classes from DeepSpeed's own exceptions ----------------------------------------------------


def _failed(phase, exc):
    err = {
        "phase": phase,
        "type": type(exc).__name__,
        "message": str(exc),
        "traceback": "".join(traceback.format_exception(exc)),
        "time": 1.0,
    }
    return classify(False, 1, [{"rank": 0, "status": "failed", "error": err, "phases": {}}], {})


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the exception is the point
        return e
    raise AssertionError("expected DeepSpeed to raise")


def test_deepspeed_rejections_and_kernel_builds_are_classified():
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.config import DeepSpeedConfig
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    seed_block = _raised(lambda: DeepSpeedZeroConfig(stage=3, mics_shard_size=2))  # pydantic: extra input
    assert _failed("init", seed_block)["cause"] == "config_rejected"
    removed = _raised(
        lambda: DeepSpeedConfig(
            {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 3, "mics_shard_size": 2}}
        )
    )
    assert "MiCS" in str(removed) and _failed("load", removed)["cause"] == "config_rejected"  # zero.Init parses at load
    # kernel injection's op on an accelerator without it (here: CPU) fails when the op is loaded
    no_op = _raised(lambda: get_accelerator().create_op_builder("InferenceBuilder").load())
    assert _failed("init", no_op)["cause"] == "kernel_build_error"
    jit = RuntimeError("Unable to JIT load the transformer_inference op due to ninja not being installed.")
    assert _failed("init", jit)["cause"] == "kernel_build_error"  # text of deepspeed/ops/op_builder/builder.py


# ---- end to end on CPU ------------------------------------------------------------------------------------


def _sweep(tmp_path_factory, cache_dir, args):
    """The jobs' result.json files: what each engine did, none of it read from MLflow (tracking off)."""
    cwd = tmp_path_factory.mktemp("engines")
    run_dsexp(["-m", *args, "tracking=none", "hydra.sweep.dir=multirun/s"], cwd, cache_dir)
    return sweep_results(cwd / "multirun" / "s")


@pytest.fixture(scope="module")
def runs(tmp_path_factory, cache_dir):
    """One multirun: the seed's accepted form and the engines that cut per-rank weights, at tp=2. AutoTP with the
    preset policy (experiment=autotp at tp=2, the same job) is test_published_code.py's eager load: tested there."""
    results = _sweep(tmp_path_factory, cache_dir, ["experiment=seed_issue_accepted,hf_tp,zero3", "tp=2"])
    return by_name(results, lambda r: r["config"]["variant"])


@pytest.fixture(scope="module")
def slow_runs(tmp_path_factory, cache_dir):
    return by_name(
        _sweep(tmp_path_factory, cache_dir, ["experiment=autotp_zero3,zero3_offload,seed_issue", "tp=2"]),
        lambda r: r["config"]["variant"],
    )


def _ok(res):
    assert res["status"] == "ok", res.get("failure")
    assert res["correctness"]["passed"], res["correctness"]  # first-step logits match the tp=1 eager reference
    return res


def _replicated(res):
    return set(res["ranks"][1]["engine"]["replicated"])


# its cause: test_deepspeed_rejections_and_kernel_builds_are_classified; the seed's own script rejected end to end:
# test_script_workload.py::test_the_seeds_script_as_written_is_rejected_by_todays_deepspeed_and_recorded
@pytest.mark.slow
def test_seed_call_is_rejected_by_this_deepspeed_with_its_message(slow_runs):
    res = slow_runs["seed_issue"]
    assert res["status"] == "failed"
    f = res["failure"]
    assert (f["cause"], f["phase"], f["type"]) == ("config_rejected", "init", "ValidationError")
    assert "mics_shard_size" in f["message"] and "Extra inputs are not permitted" in f["message"]


def test_seed_accepted_form_shards_nothing(runs):
    res = _ok(runs["seed_issue_accepted"])
    eng = res["engine"]
    assert eng["kernel_policy_layers"] == [] and eng["modules"] == {"removed": {}, "added": {}}
    assert {
        "zero",
        "zero.stage",
        "zero.max_live_parameters",
        "zero.model_persistence_threshold",
        "max_out_tokens",
        "replace_method",
    } <= set(eng["unread_fields"])
    for rk in res["ranks"]:  # every rank holds the whole model at tp=2
        assert rk["engine"]["weight_fraction"] == 1.0
        assert rk["phases"]["init"]["weights_device"] >= rk["phases"]["load"]["weights_device"] * 0.99
        assert "model.layers.1.attention.wqkv.weight" in rk["engine"]["replicated"]


# AutoTP with the preset policy at tp=2: test_autotp_with_the_preset_policy_shards_and_matches_tp1 in
# test_published_code.py (experiment=autotp's eager load there is the job this sweep ran as its `autotp` variant)


def test_hf_tp_shards_layers_head_and_embedding(runs):
    """transformers TP on the Llama layout (its own plan); InternLM2's code as published has none (see validation)."""
    res = _ok(runs["hf_tp"])
    plan = res["engine"]["tp_plan"]
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise" and plan["model.embed_tokens"] == "embedding_rowwise"
    replicated = _replicated(res)
    assert not {"model.embed_tokens.weight", "lm_head.weight"} & replicated
    assert all(rk["engine"]["weight_fraction"] == pytest.approx(0.5, abs=0.01) for rk in res["ranks"])


def test_hf_tp_is_refused_for_a_model_without_a_plan():
    with pytest.raises(ConfigError, match="defines no tensor-parallel plan"):
        spec_of("model=internlm2_tiny", "engine=hf_tp", "tp=2")


def test_zero_inference_partitions_at_load_and_every_rank_generates(runs):
    res = _ok(runs["zero3"])
    assert res["engine"]["partitioned_at_load"] and res["engine"]["unread_fields"] == []
    r0, r1 = res["ranks"]
    assert r0["generate"]["tokens"] == r1["generate"]["tokens"]
    for rk in res["ranks"]:
        assert rk["engine"]["weight_fraction"] == pytest.approx(0.5, abs=0.01)
        assert rk["phases"]["load"]["weights_device"] < 0.6 * rk["engine"]["weight_bytes_full"]  # 1/2 already at load
        assert not any(n.endswith(".weight") for n in rk["engine"]["replicated"])  # only the rotary buffers


@pytest.mark.slow
def test_autotp_zero3_shards_with_the_policy(slow_runs):
    res = _ok(slow_runs["autotp_zero3"])
    eng = res["engine"]
    assert eng["modules"]["added"] == {"LinearLayer": 6, "LinearAllreduce": 4}
    assert eng["call"]["ds_config"]["tensor_parallel"]["autotp_size"] == 2 and eng["unread_fields"] == []
    assert all(rk["engine"]["weight_fraction"] <= 0.5 + 1e-6 for rk in res["ranks"])


@pytest.mark.slow
def test_zero_offload_runs_and_records_the_offload(slow_runs):
    res = _ok(slow_runs["zero3_offload"])
    assert res["engine"]["call"]["ds_config"]["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "zero.offload_param" not in res["engine"]["unread_fields"]
