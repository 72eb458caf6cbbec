"""The memory model against sizes derived independently from the architecture numbers, and against
DeepSpeed's own split rules (KV-head units, 64-grain MLP, lm_head on the hidden dim, `output` replicated)."""

from __future__ import annotations

import pytest
import torch

from dsexp.analysis.memory import predict
from dsexp.engines.placement import place

from helpers.analysis_cases import (
    GIB,
    INTERNLM2_POLICY,
    MEDIUM,
    TINY,
    InternLM2ForCausalLM,
    config,
    result,
    strategy,
)


def llama_bytes(d, tp, itemsize=2, embed_split=1, head_split=None, buffers_itemsize=4):
    """Per-rank bytes of a Llama under AutoTP, from the architecture numbers alone. The RoPE buffers stay fp32:
    init_inference casts them, and dsexp puts them back as the model built them (load.restore_buffers)."""
    h, i, L, nh, kv, V = (
        d[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
        )
    )
    hd = h // nh
    layer_matrices = (nh * hd * h) * 2 + (kv * hd * h) * 2 + 3 * i * h  # q, o, k, v, gate/up/down
    head_split = tp if head_split is None else head_split
    params = L * (layer_matrices // tp + 2 * h) + h + V * h // embed_split + V * h // head_split
    return params * itemsize + 2 * (hd // 2) * buffers_itemsize  # inv_freq + original_inv_freq


@pytest.mark.parametrize("tp", [1, 2])
def test_autotp_llama_matches_architecture_numbers(tp):
    p = predict(result(config(tp), [0] * tp), tp)
    # tp=1: AutoTP does not run, nothing is split; tp=2: layers and lm_head halved, embed_tokens and norms whole
    assert p.weights == [llama_bytes(TINY, tp)] * tp
    assert p.model_bytes == llama_bytes(TINY, 1)
    if tp == 2:
        layers = TINY["num_hidden_layers"]
        assert p.modules == {
            "removed": {"Linear": 7 * layers + 1},
            "added": {"LinearLayer": 5 * layers, "LinearAllreduce": 2 * layers, "LmHeadLinearAllreduce": 1},
        }
        rep = p.replicated()
        assert rep["model.embed_tokens.weight"] == TINY["vocab_size"] * TINY["hidden_size"] * 2
        assert "lm_head.weight" not in rep and "model.rotary_emb.inv_freq" in rep
    else:
        assert not p.sharded and p.modules == {"removed": {}, "added": {}}


def test_without_restore_buffers_init_inference_keeps_the_rope_buffers_cast():
    cfg = config(2)
    cfg["load"]["restore_buffers"] = False
    assert predict(result(cfg, [0, 0]), 2).weights == [llama_bytes(TINY, 2, buffers_itemsize=2)] * 2


def test_uneven_tp_splits_follow_deepspeed_kv_heads_and_grain():
    dims = dict(TINY, num_attention_heads=8, num_key_value_heads=8, intermediate_size=11 * 64)
    p = predict(result(config(3, dims), [0] * 3), 3)
    by = {pl.name: pl for pl in p.placements}
    hd, h = 256 // 8, 256
    # 8 KV heads on 3 ranks -> 3/3/2 heads; 11 grains of 64 -> 4/4/3 grains;
    # lm_head (hidden dim 256 = 4 grains) -> 2/1/1
    assert by["model.layers.0.self_attn.q_proj.weight"].local == tuple(n * hd * h * 2 for n in (3, 3, 2))
    assert by["model.layers.0.mlp.up_proj.weight"].local == tuple(n * 64 * h * 2 for n in (4, 4, 3))
    assert by["model.layers.0.mlp.down_proj.weight"].local == tuple(h * n * 64 * 2 for n in (4, 4, 3))
    assert by["lm_head.weight"].local == tuple(1024 * n * 64 * 2 for n in (2, 1, 1))
    assert sum(p.weights) > p.model_bytes  # replicated parts count on every rank


def _strategy(**kw):
    return strategy(**{"max_out_tokens": 1024, **kw})


def _meta_internlm2():
    with torch.device("meta"):
        return InternLM2ForCausalLM().to(torch.bfloat16)


def test_internlm2_policy_shards_layers_but_output_and_embeddings_stay_whole():
    placements, modules, _, error = place(_meta_internlm2(), _strategy(policy=INTERNLM2_POLICY), 2)
    by = {p.name: p for p in placements}
    assert error is None
    assert by["output.weight"].how == "replicated" and by["model.tok_embeddings.weight"].how == "replicated"
    # wqkv rows are (8 q + 2 k + 2 v) x 32 = 384: split in KV-head units, one group per rank
    assert by["model.layers.0.attention.wqkv.weight"].local == (192 * 256 * 2,) * 2
    assert by["model.layers.0.attention.wo.weight"].how == "LinearAllreduce"
    assert by["model.layers.0.feed_forward.w2.weight"].how == "LinearAllreduce"
    assert modules == {"removed": {"Linear": 10}, "added": {"LinearLayer": 6, "LinearAllreduce": 4}}


def test_internlm2_without_policy_kernel_injection_shards_nothing_and_autotp_refuses():
    model = _meta_internlm2()
    placements, modules, notes, error = place(model, _strategy(kernel_inject=True), 2)
    assert all(p.how == "replicated" for p in placements) and modules == {"removed": {}, "added": {}}
    assert "no policy for InternLM2DecoderLayer" in notes[0]
    _, _, _, error = place(model, _strategy(), 2)
    assert error and "policy" in error  # DeepSpeed's AutoTP parser finds no row-parallel layers


def test_kernel_injection_with_a_policy_splits_llama_layers():
    p = predict(result(config(2, kernel_inject=True, device="cuda"), [0, 0]), 2)
    assert p.modules["removed"] == {"LlamaDecoderLayer": TINY["num_hidden_layers"]}
    assert p.weights_max == llama_bytes(TINY, 2, head_split=1)  # lm_head is not touched by kernel injection
    assert p.tokens == 1024  # the kernel workspace is sized for max_out_tokens


def test_zero3_partitions_every_parameter_and_offload_empties_the_gpu():
    cfg = config(2, engine="zero_inference", zero="stage3", stage=3)
    p = predict(result(cfg, [0, 0]), 2)
    # every tiny parameter has an even numel: each rank's partition is exactly half; buffers stay fp32 and whole
    expect = llama_bytes(TINY, 1, buffers_itemsize=0) // 2 + 2 * 32 * 4
    assert p.weights == [expect, expect] and {pl.how for pl in p.placements} == {"zero3", "replicated"}
    off = predict(result(dict(cfg, device="cuda", zero=dict(cfg["zero"], offload="cpu")), [0, 0]), 2)
    assert off.weights == [2 * 32 * 4] * 2


def test_hf_tp_plan_shards_embeddings_vocab_parallel():
    p = predict(result(config(2, engine="hf_tp"), [0, 0]), 2)
    assert p.weights == [llama_bytes(TINY, 2, embed_split=2, buffers_itemsize=4)] * 2
    by = {pl.name: pl for pl in p.placements}
    assert by["model.embed_tokens.weight"].how == "embedding_rowwise"


def test_kv_cache_floor_and_start_overhead_on_gpu():
    res = result(config(2, device="cuda"), [GIB, GIB], gpu_start=600 * 2**20, gpu_peak=3 * GIB)
    p = predict(res, 2)
    d = TINY
    tokens = 18 + 16  # prompt ids recorded by the rank + new tokens
    kv = (
        2
        * d["num_hidden_layers"]
        * (d["num_key_value_heads"] // 2)
        * (d["hidden_size"] // d["num_attention_heads"])
        * tokens
        * 2
    )
    assert p.kv_cache == [kv, kv] and p.overhead == 600 * 2**20
    assert p.floor() == max(p.reserve) + kv + 600 * 2**20
    assert p.weights_max < max(p.reserve) == 2 * 2**20 * -(-max(p.reserve) // (2 * 2**20))  # whole 2 MiB segments


def test_host_cost_by_loading_strategy():
    full = predict(result(config(1, MEDIUM), [0]), 1).model_bytes
    eager = predict(result(config(2, MEDIUM), [0, 0]), 2)
    split = [sum(pl.local[r] for pl in eager.placements if pl.how != "replicated") for r in range(2)]
    assert eager.host.anon == split and eager.host.kept == split  # mmap: private = the TP slices kept on the host
    conv = predict(result(config(2, MEDIUM, dtype="fp32"), [0, 0]), 2)
    rope = sum(pl.full for pl in eager.placements if pl.is_buffer)  # fp32 in both runs
    assert conv.host.anon == [2 * (full - rope) + rope] * 2  # a private converted (fp32) copy of the model per rank
    sharded = predict(result(config(2, MEDIUM, load="sharded"), [0, 0]), 2)
    assert sharded.host.anon == sharded.weights  # a CPU rank keeps what it read: its weights
    biggest = max(pl.local[0] for pl in sharded.placements if not pl.is_buffer)
    assert sharded.host.file == [biggest] * 2 == [MEDIUM["vocab_size"] * MEDIUM["hidden_size"] * 2] * 2  # embeddings
    meta = predict(result(config(2, MEDIUM, load="meta"), [0, 0]), 2)
    assert meta.host.anon[0] >= meta.host.file[0] > 0  # every checkpoint file read in full, one at a time
    gpu = predict(result(config(2, MEDIUM, device="cuda"), [0, 0]), 2)
    assert gpu.host.anon == [0, 0] and gpu.host.node == 0  # mmap'd and moved to the GPU: nothing private stays


def internlm2_config(tp, **kw):
    """A run of the remote-code InternLM2 (rebuilt from arch + dims: its folder is not on this machine)."""
    cfg = config(tp, **kw)
    cfg["model"].update(arch="internlm2", trust_remote_code=True)
    return cfg


def internlm2_bytes(d, itemsize=2):
    """(parameter bytes, buffer bytes) of the InternLM2 layout from the architecture numbers alone: fused wqkv,
    wo, w1/w3/w2, two norms per layer, embeddings, `output`, final norm; per layer bf16 cos/sin tables of
    max_position x head_dim and an fp32 inv_freq of head_dim / 2."""
    h, i, L, nh, kv, V, P = (
        d[k]
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "vocab_size",
            "max_position_embeddings",
        )
    )
    hd = h // nh
    params = L * ((nh + 2 * kv) * hd * h + nh * hd * h + 3 * i * h + 2 * h) + 2 * V * h + h
    return params * itemsize, L * (2 * P * hd * itemsize + hd // 2 * 4)


@pytest.mark.parametrize("engine,offload", [("zero_inference", "none"), ("zero_inference", "cpu")])
def test_remote_code_model_is_sized_in_the_run_dtype_for_engines_that_do_not_cast(engine, offload):
    """The meta build honours the dtype for remote code too (it used to build fp32: every prediction doubled)."""
    zero = dict(zero="stage3", stage=3, offload=offload) if engine == "zero_inference" else {}
    p = predict(result(internlm2_config(2, engine=engine, device="cuda", **zero), [0, 0]), 2)
    params, buffers = internlm2_bytes(TINY)
    assert p.model_bytes == params + buffers
    h, V, L = TINY["hidden_size"], TINY["vocab_size"], TINY["num_hidden_layers"]
    whole = (V * h + (2 * L + 1) * h) * 2  # not in the model's TP plan: tok_embeddings and the norms
    expect = {
        ("zero_inference", "none"): params // 2 + buffers,  # params 1/tp, buffers whole
        ("zero_inference", "cpu"): buffers,  # partitions on the host
    }[(engine, offload)]
    assert p.weights == [expect, expect] and whole < params


def test_hf_tp_on_a_model_without_a_plan_is_an_error_not_a_guess():
    """InternLM2's code as published has no TP plan: transformers refuses it, so the model predicts no sharding."""
    p = predict(result(internlm2_config(2, engine="hf_tp", device="cuda"), [0, 0]), 2)
    params, buffers = internlm2_bytes(TINY)
    assert "no tensor-parallel plan" in p.error and p.weights == [params + buffers] * 2


def test_autotp_zero3_keeps_zero3_partitions_and_autotp_modules():
    zero = predict(result(config(2, engine="zero_inference", zero="stage3", stage=3, device="cuda"), [0, 0]), 2)
    both = predict(result(config(2, engine="autotp_zero3", zero="stage3", stage=3, device="cuda"), [0, 0]), 2)
    autotp = predict(result(config(2, device="cuda"), [0, 0]), 2)
    assert both.weights == zero.weights < autotp.weights  # params 1/tp, buffers whole: embeddings split too
    assert both.modules == autotp.modules and both.modules["added"]["LinearAllreduce"] == 2 * TINY["num_hidden_layers"]


def test_floor_overhead_is_the_memory_outside_pytorch_over_the_run():
    """NVML process used - torch reserved at its largest over the phases (communicator, workspaces appear after
    `start`) + the device's own reserve at start (device used - process used)."""
    res = result(config(2, device="cuda"), [GIB, GIB], gpu_start=GIB, gpu_peak=3 * GIB)
    mib = 2**20
    gpu = {
        "start": (1500, 900, 0),
        "load": (1500, 900, 0),
        "init": (22000, 20500, 20480),
        "generate": (23500, 22900, 20600),
    }
    for rk in res["ranks"]:
        for ph, (dev, proc, reserved) in gpu.items():
            rk["phases"][ph]["gpu"] = {
                "nvml_device_used": dev * mib,
                "nvml_process_used": proc * mib,
                "gpu_reserved": reserved * mib,
            }
    p = predict(res, 2)
    assert p.overhead == (22900 - 20600 + 1500 - 900) * mib  # generate: 2300 MiB outside PyTorch + 600 MiB reserve
    assert p.floor() == max(r + k for r, k in zip(p.reserve, p.kv_cache)) + p.overhead


def test_host_model_for_gpu_runs_by_loading_strategy():
    """mmap without conversion: pages of what the rank takes (rows of dim-0 splits, whole otherwise);
    sharded: one tensor at a time, nothing private stays; meta: one writer-sized file at a time."""
    eager = {tp: predict(result(config(tp, MEDIUM, device="cuda"), [0] * tp), tp) for tp in (2, 4)}
    for tp, p in eager.items():
        rows = sum(pl.local[0] if pl.dim == 0 else pl.full for pl in p.placements if not pl.is_buffer)
        assert p.host.file == [rows] * tp and p.host.anon == [0] * tp
    assert eager[4].host.file[0] < eager[2].host.file[0] < eager[2].model_bytes
    sharded = [predict(result(config(tp, MEDIUM, load="sharded", device="cuda"), [0] * tp), tp) for tp in (2, 4)]
    embed = MEDIUM["vocab_size"] * MEDIUM["hidden_size"] * 2  # replicated: the largest tensor at any tp
    assert [s.host.file[0] for s in sharded] == [embed, embed] and sharded[1].host.anon == [0] * 4
    meta = predict(result(config(2, MEDIUM, load="meta", device="cuda"), [0, 0]), 2)
    assert meta.host.file[0] <= 2 * 2**20 + embed and meta.host.file[0] < meta.model_bytes  # shard_mb=2: no whole model
    off = predict(
        result(
            config(4, MEDIUM, engine="zero_inference", zero="stage3", stage=3, offload="cpu", device="cuda"), [0] * 4
        ),
        4,
    )
    params = sum(pl.full for pl in off.placements if pl.how == "offloaded")
    assert off.host.kept[0] == pytest.approx(params / 4, abs=4096)  # offloaded partitions live on the host


def test_autotp_zero3_with_a_policy_keeps_autotp_shards_and_zero3_partitions_elsewhere():
    from dsexp.engines.base import INFER

    model = InternLM2ForCausalLM().to(torch.bfloat16)
    s = strategy(engine="autotp_zero3", policy=INFER, zero_stage=3)
    placements, modules, _, error = place(model, s, 2)
    assert error is None and modules["added"] == {"LinearLayer": 6, "LinearAllreduce": 4}  # no lm_head: config specs
    how = {p.name: p.how for p in placements}
    assert how["model.layers.0.attention.wo.weight"] == "LinearAllreduce"
    assert how["output.weight"] == how["model.tok_embeddings.weight"] == "zero3"  # partitioned, not replicated
