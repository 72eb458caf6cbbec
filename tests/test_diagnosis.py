"""Every diagnosis rule on a constructed case: the sentence names the cause and carries the numbers."""

from __future__ import annotations

import pytest

from dsexp.analysis.diagnosis import diagnose
from dsexp.analysis.measured import human
from dsexp.analysis.memory import predict

from helpers.analysis_cases import GIB, MEDIUM, MIB, config, result


def findings(res, siblings=()):
    found = diagnose(res, predict(res), list(siblings))
    return {f.code: f for f in found}, found


@pytest.fixture(scope="module")
def full():
    """The tiny model's bytes at tp=1 and its predicted per-rank bytes at tp=2."""
    return predict(result(config(1), [0]), 1).model_bytes, predict(result(config(2), [0, 0]), 2).weights_max


def test_seed_like_run_is_nothing_sharded(full):
    whole, _ = full
    res = result(config(2, kernel_inject=True, device="cuda"), [whole, whole])  # no module replaced
    by, found = findings(res)
    f = by["nothing_sharded"]
    assert f.severity == "problem" and found[0] is f
    assert "= 100% of the model" in f.text and "at tp=2: nothing was sharded (no module was replaced)" in f.text
    assert "GPU" in f.text and "the memory model expected" in f.text  # tiny Llama has a kernel policy


def test_weights_as_predicted_names_replicated_parts(full):
    _, per_rank = full
    by, _ = findings(result(config(2), [per_rank, per_rank + 1000]))
    f = by["weights_as_predicted"]
    assert f.severity == "info" and "as predicted" in f.text and "+0.1%" in f.text
    assert "replicated on every rank: model.embed_tokens.weight 512.0 KiB" in f.text


def test_weights_differ_lists_module_differences(full):
    _, per_rank = full
    mods = {"removed": {"Linear": 14}, "added": {"LinearLayer": 10, "LinearAllreduce": 4}}  # lm_head left whole
    by, _ = findings(
        result(
            config(2), [int(per_rank * 1.15)] * 2, modules=mods, engine_extra={"replicated": {"lm_head.weight": 524288}}
        )
    )
    f = by["weights_differ"]
    assert f.severity == "problem" and "+15.0%" in f.text
    assert "0 LmHeadLinearAllreduce modules instead of 1" in f.text
    assert "replicated although the model shards them: lm_head.weight" in f.text


def test_host_private_copy_from_dtype_conversion():
    cfg = config(2, MEDIUM, name="medium", dtype="fp32", model_dtype="bf16")
    p = predict(result(cfg, [0, 0]), 2)
    copy = p.model_bytes + max(p.host.kept) + 150 * MIB  # the converted model, the kept slices, imports
    by, _ = findings(result(cfg, p.weights, anon_growth=copy, node=(4 * GIB, 4 * GIB + 2 * copy)))
    f = by["host_private_copy"]
    assert "host memory grew by one model per rank" in f.text
    assert "each rank made a private copy while loading (dtype conversion bf16->fp32)" in f.text
    assert (
        f"({human(p.model_bytes + 150 * MIB)} private per rank beyond its own slices, the model is "
        f"{human(p.model_bytes)})" in f.text
    )


def test_host_shared_when_mmapped_and_small_models_are_not_judged():
    cfg = config(2, MEDIUM, name="medium", device="cuda")
    p = predict(result(cfg, [0, 0]), 2)
    by, _ = findings(result(cfg, p.weights, anon_growth=50 * MIB))
    assert "private host memory per rank grew by only 50.00 MiB" in by["host_shared"].text
    tiny, _ = findings(result(config(2), [0, 0], anon_growth=GIB))  # 3 MiB model: below the noise of imports
    assert "host_private_copy" not in tiny and "host_shared" not in tiny


def test_zero_settings_unread(full):
    _, per_rank = full
    by, _ = findings(
        result(
            config(2, zero="seed", stage=3),
            [per_rank] * 2,
            unread=["max_out_tokens", "zero.stage", "zero.mics_shard_size"],
        )
    )
    assert by["zero_unread"].text == (
        "ZeRO settings were passed to init_inference and never read "
        "(zero.stage, zero.mics_shard_size): they had no effect"
    )
    assert by["fields_unread"].text.endswith("max_out_tokens")


def test_incorrect_output_with_buffer_cast_evidence(full):
    _, per_rank = full
    by, found = findings(
        result(
            config(2),
            [per_rank] * 2,
            status="failed",
            passed=False,
            rel_err=0.0134,
            buffers=(256, 128),
            failure={"cause": "incorrect_output"},
        )
    )
    f = by["incorrect_output"]
    assert found[0].severity == "problem" and "failed" not in by
    assert (
        "outputs differ from tp=1 beyond tolerance: first-step logits rel. L2 error 0.0134 > tolerance 0.01" in f.text
    )
    assert "buffers shrank from 256 B to 128 B at init" in f.text


def test_parameters_left_on_meta(full):
    _, per_rank = full
    names = [f"model.layers.{i}.input_layernorm.weight" for i in range(7)]
    by, _ = findings(result(config(2), [per_rank] * 2, on_meta=names))
    assert by["on_meta"].text.startswith("7 parameters were left on the meta device (model.layers.0.input_layernorm")


def test_failed_run_names_cause_rank_and_phase():
    res = result(
        config(2),
        [],
        status="failed",
        passed=None,
        failure={"cause": "oom", "rank": 1, "phase": "init", "message": "CUDA out of memory.\nmore"},
    )
    by, _ = findings(res)
    assert by["failed"].text == "the run failed (oom) on rank 1 in the init phase: CUDA out of memory."


def test_per_device_memory_flat_with_tp_and_host_growing_per_rank():
    cfg1, cfg2 = config(1, MEDIUM, name="medium", device="cuda"), config(2, MEDIUM, name="medium", device="cuda")
    whole = predict(result(cfg1, [0]), 1).model_bytes
    tp1 = result(cfg1, [whole], gpu_start=GIB, gpu_peak=whole + 2 * GIB, node=(4 * GIB, 4 * GIB + whole))
    tp2 = result(
        cfg2, [whole] * 2, gpu_start=GIB, gpu_peak=whole + 2 * GIB, node=(4 * GIB, 4 * GIB + 2 * whole), job="1"
    )
    by, _ = findings(tp2, [tp1])
    assert by["flat_with_tp"].text.startswith("per-GPU peak did not fall from tp=1 to tp=2")
    assert "about 1.0 model(s) per added rank" in by["host_grows_per_rank"].text
    text = by["gpu_floor"].text
    assert "per-GPU peak" in text and "outside PyTorch's allocator 1.00 GiB" in text
    # the floor holds the run's activations as the capacity model predicts them, not weights + KV cache alone
    from dsexp.analysis.memory import workload_floor

    floor = workload_floor(tp2, predict(tp2))
    assert floor["terms"]["kv_cache"] > 0 and any(k.startswith("activations") for k in floor["terms"])
    assert floor["bytes"] == sum(floor["terms"].values()) > predict(tp2).floor()
    assert f"vs floor {floor['bytes'] / GIB:.2f} GiB at batch 1" in text


def test_falls_with_tp_is_info(full):
    whole, per_rank = full
    by, _ = findings(result(config(2), [per_rank] * 2, job="1"), [result(config(1), [whole])])
    assert by["falls_with_tp"].severity == "info" and "(-42%)" in by["falls_with_tp"].text


def test_predicted_refusal_is_reported():
    res = result(config(2, engine="init_inference"), [0, 0])
    res["engine"]["injection_policy"] = None
    p = predict(res)
    p.error = "Not able to determine model policy automatically. Please provide policy."
    found = {f.code: f for f in diagnose(res, p)}
    assert "expects the engine to refuse this: Not able to determine" in found["predicted_refusal"].text


def test_engine_weight_fraction_stands_in_for_a_missing_census(full):
    whole, _ = full
    res = result(config(2, kernel_inject=True, device="cuda"), [whole, whole], engine_extra={"weight_fraction": 1.0})
    for rk in res["ranks"]:
        del rk["phases"]["init"]["weights_device"]
    by, _ = findings(res)
    assert "nothing was sharded" in by["nothing_sharded"].text


def test_init_transient_names_the_whole_model_on_the_gpu_before_partitioning():
    cfg = config(2, MEDIUM, name="medium", engine="autotp_zero3", zero="stage3", stage=3, device="cuda")
    p = predict(result(cfg, [0, 0]), 2)
    res = result(cfg, p.weights, gpu_start=GIB, gpu_peak=p.model_bytes + 3 * GIB)
    for rk in res["ranks"]:
        rk["phases"]["init"]["gpu"] = {
            "gpu_alloc_peak": p.model_bytes - 10 * MIB,
            "gpu_reserved_peak": p.model_bytes,
            "gpu_reserved": p.model_bytes,
        }
    f = findings(res)[0]["init_transient"]
    assert f.severity == "problem"
    assert f.text.startswith(
        f"init phase peak = {human(p.model_bytes - 10 * MIB)} allocated ({human(p.model_bytes)} "
        f"reserved) against {human(p.weights_max)} of weights kept: the whole model "
        f"({human(p.model_bytes)}) was on the GPU before being partitioned"
    )
    assert "PyTorch kept" in f.text and f"per-GPU peak is {(p.model_bytes + 3 * GIB) / GIB:.2f} GiB" in f.text
    # no transient without a load/init allocation far above the weights kept
    for rk in res["ranks"]:
        rk["phases"]["init"]["gpu"]["gpu_alloc_peak"] = p.weights_max + 10 * MIB
    assert "init_transient" not in findings(res)[0]


def test_failed_run_gets_no_floor_or_scaling_comparison():
    cfg1, cfg2 = config(1, MEDIUM, name="medium", device="cuda"), config(2, MEDIUM, name="medium", device="cuda")
    whole = predict(result(cfg1, [0]), 1).model_bytes
    tp1 = result(cfg1, [whole], gpu_start=GIB, gpu_peak=whole + 2 * GIB)
    failure = {"cause": "config_rejected", "rank": 0, "phase": "init", "message": "ValidationError: bad zero"}
    tp2 = result(
        cfg2,
        [0, 0],
        status="failed",
        passed=None,
        failure=failure,
        gpu_start=GIB,
        gpu_peak=GIB,
        job="1",
        anon_growth=100 * MIB,
    )
    for rk in tp2["ranks"]:  # it loaded, then failed in init: no census, no generate
        del rk["phases"]["init"]["weights_device"], rk["phases"]["generate"]
    by, found = findings(tp2, [tp1])
    assert set(by) == {"failed", "host_shared"}  # no gpu_floor, flat_with_tp, weights comparison
    assert by["host_shared"].text.endswith("(up to the failure)")
    # and a completed run is not compared with a failed sibling at a smaller tp
    tp4 = result(
        config(4, MEDIUM, name="medium", device="cuda"), [whole] * 4, gpu_start=GIB, gpu_peak=whole + 2 * GIB, job="2"
    )
    assert "flat_with_tp" not in findings(tp4, [tp2])[0]
    assert "flat_with_tp" in findings(tp4, [tp2, tp1])[0]


def test_a_weights_difference_on_another_transformers_says_the_model_is_built_here():
    """On a stack the ranks import another transformers than the one the memory model builds with: the
    diagnosis of a difference says so (Qwen2's rotary tables moved between 4.42 and 5.x)."""
    import transformers

    from dsexp.analysis.diagnosis import _other_transformers

    assert _other_transformers({"software": {"versions": {"transformers": transformers.__version__}}}) == ""
    assert _other_transformers({}) == ""
    note = _other_transformers({"software": {"versions": {"transformers": "4.42.4"}}})
    assert "ranks ran transformers 4.42.4" in note and transformers.__version__ in note


def test_a_finding_ending_in_an_errors_own_full_stop_gets_no_second_one():
    """A user's script given a folder that is not there: huggingface_hub's message ends in "needed.", and the
    diagnosis read "... if needed..": a finding is a sentence with one full stop."""
    from dsexp.analysis.sections.run_findings import sentence

    assert sentence("the run failed (script_error): OSError: Use `repo_type` argument if needed.").endswith("needed.")
    assert not sentence("x needed.").endswith("..")
    assert sentence("weights on each rank = 3.25 MiB") == "weights on each rank = 3.25 MiB."
