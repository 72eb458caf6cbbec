"""The InternLM2-layout model: loads through trust_remote_code from its folder, generates with a KV cache,
computes what a Llama-layout GQA transformer with the same weights computes, and has InternLM2-20B's size. Like the
published code it has the published code's traps: rotary buffers computed in __init__ only (transformers >= 5 loads
them uninitialised; dsexp recomputes them), no tensor-parallel plan, attention sized by its module attributes."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from dsexp.core.compat import dtype_kwargs, transformers_version
from dsexp.models.writer import ensure_checkpoint, meta_model

DIMS = dict(
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
    max_position_embeddings=64,
    rope_theta=10000.0,
)
DIMS_20B = dict(
    hidden_size=6144,
    intermediate_size=16384,
    num_hidden_layers=48,
    num_attention_heads=48,
    num_key_value_heads=8,
    vocab_size=92544,
    max_position_embeddings=32768,
    rope_theta=1e6,
)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return ensure_checkpoint(str(tmp_path_factory.mktemp("ckpt")), "internlm2_t", "internlm2", DIMS, "bf16").path


def test_folder_ships_remote_code_and_auto_map(folder):
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "internlm2"
    assert cfg["auto_map"] == {
        "AutoConfig": "configuration_internlm2.InternLM2Config",
        "AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM",
    }
    assert (folder / "modeling_internlm2.py").is_file() and (folder / "configuration_internlm2.py").is_file()


def loaded(folder, dtype=torch.bfloat16):
    """from_pretrained, then dsexp's buffer recomputation (what every dsexp load does)."""
    from dsexp.rank.loading.buffers import after_load

    m = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **dtype_kwargs(dtype)).eval()
    ctx = SimpleNamespace(
        model_dir=folder, torch_dtype=dtype, spec=SimpleNamespace(model=SimpleNamespace(trust_remote_code=True))
    )
    return m, after_load(m, ctx, recompute=True)[1]


def test_loads_via_trust_remote_code_and_generates(folder):
    m, report = loaded(folder)
    assert type(m).__module__.startswith("transformers_modules.")  # the folder's code, not dsexp's
    names = dict(m.named_parameters())
    assert names["model.layers.1.attention.wqkv.weight"].shape == ((4 + 2 * 2) * 32, 128)
    assert {
        "model.tok_embeddings.weight",
        "model.layers.0.attention.wo.weight",
        "model.layers.0.feed_forward.w1.weight",
        "model.layers.0.feed_forward.w2.weight",
        "model.layers.0.feed_forward.w3.weight",
        "model.layers.0.attention_norm.weight",
        "model.layers.0.ffn_norm.weight",
        "model.norm.weight",
        "output.weight",
    } <= set(names)
    assert type(m.model.norm).__name__ == "InternLM2RMSNorm"
    assert type(m.model.layers[0]).__name__ == "InternLM2DecoderLayer"
    assert report["checked"] == 3 * DIMS["num_hidden_layers"]  # inv_freq, cos and sin in every layer
    rot = m.model.layers[0].attention.rotary_emb
    fresh = type(rot)(rot.dim, rot.max_position_embeddings, rot.base)
    assert torch.equal(rot.inv_freq, fresh.inv_freq) and torch.allclose(
        rot.cos_cached.float(), fresh.cos_cached.float(), atol=1e-2
    )

    ids = torch.tensor([[5, 17, 200, 42, 9]])
    out = m.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=6,
        min_new_tokens=6,
        do_sample=False,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape == (1, 11)
    with torch.no_grad():  # the KV-cached steps equal one full forward pass over the generated sequence
        full = m(out.sequences[:, :-1], use_cache=False).logits[0, 4:]
    assert torch.allclose(torch.stack([lg[0] for lg in out.logits]), full, atol=1e-3)
    assert torch.equal(out.sequences[0, 5:], full.argmax(-1))


def _as_llama(m):
    """A Llama model with the same weights: wqkv's per-KV-head groups [q x g, k, v] split into q/k/v."""
    c = m.config
    d, g, kv = (
        c.hidden_size // c.num_attention_heads,
        c.num_attention_heads // c.num_key_value_heads,
        c.num_key_value_heads,
    )
    llama = LlamaForCausalLM(
        LlamaConfig(
            hidden_size=c.hidden_size,
            intermediate_size=c.intermediate_size,
            num_hidden_layers=c.num_hidden_layers,
            num_attention_heads=c.num_attention_heads,
            num_key_value_heads=kv,
            vocab_size=c.vocab_size,
            max_position_embeddings=c.max_position_embeddings,
            rope_theta=c.rope_theta,
            rms_norm_eps=c.rms_norm_eps,
            tie_word_embeddings=False,
            attention_bias=False,
        )
    ).eval()
    sd = {
        "model.embed_tokens.weight": m.model.tok_embeddings.weight,
        "lm_head.weight": m.output.weight,
        "model.norm.weight": m.model.norm.weight,
    }
    for i, layer in enumerate(m.model.layers):
        w = layer.attention.wqkv.weight.view(kv, g + 2, d, c.hidden_size)
        p = f"model.layers.{i}."
        sd.update(
            {
                p + "self_attn.q_proj.weight": w[:, :g].reshape(-1, c.hidden_size),
                p + "self_attn.k_proj.weight": w[:, g].reshape(-1, c.hidden_size),
                p + "self_attn.v_proj.weight": w[:, g + 1].reshape(-1, c.hidden_size),
                p + "self_attn.o_proj.weight": layer.attention.wo.weight,
                p + "mlp.gate_proj.weight": layer.feed_forward.w1.weight,
                p + "mlp.up_proj.weight": layer.feed_forward.w3.weight,
                p + "mlp.down_proj.weight": layer.feed_forward.w2.weight,
                p + "input_layernorm.weight": layer.attention_norm.weight,
                p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
            }
        )
    llama.load_state_dict(sd, strict=False)
    return llama


def test_matches_llama_math_with_unfused_weights(folder):
    m, _ = loaded(folder, torch.float32)
    llama = _as_llama(m)
    ids = torch.tensor([[3, 99, 7, 250, 31, 8, 64]])
    with torch.no_grad():
        ours, ref = m(ids).logits, llama(ids).logits
    assert torch.allclose(ours, ref, atol=1e-4, rtol=1e-4), (ours - ref).abs().max()


def test_20b_shapes_preset_is_internlm2_20b_sized():
    cfg, model = meta_model("internlm2", DIMS_20B, "bf16")
    params = sum(p.numel() for p in model.parameters())
    rotary = sum(b.numel() for n, b in model.named_buffers() if n.endswith("_cached"))
    assert model.model.layers[0].attention.wqkv.weight.shape == (8192, 6144)  # (48 + 2 x 8) x 128
    assert 19.8e9 < params < 19.9e9 and abs(params * 2 / 2**30 - 37.0) < 0.1  # bf16 GiB
    assert rotary * 2 == 48 * 2 * 32768 * 128 * 2 == 0.75 * 2**30  # bf16 cos/sin tables, one pair per layer


def test_has_the_published_codes_traps(folder):
    """What dsexp must cope with, as with the real internlm2-chat-20b code."""
    from dsexp.models.kernel_policy import tp_plan

    raw = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True, **dtype_kwargs(torch.bfloat16)).eval()
    assert tp_plan(raw) == {}  # no tensor-parallel plan
    rot = raw.model.layers[0].attention.rotary_emb
    assert not hasattr(rot, "reset_buffers") and not hasattr(rot, "original_inv_freq")  # no recompute hook
    rot.inv_freq.fill_(float("nan"))
    raw._init_weights(rot)  # the model's own init leaves rotary buffers alone
    assert torch.isnan(rot.inv_freq).all()
    _, report = loaded(folder)
    if transformers_version() >= (5,):  # built on meta, buffers given empty memory: every one needs recomputing
        assert len(report["recomputed"]) == report["checked"]
    else:  # 4.x kept the constructor's buffers
        assert report["recomputed"] == {}
