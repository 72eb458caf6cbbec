"""The random-weight checkpoint writer: exact shapes, cached by key, both formats, loadable by transformers."""

from __future__ import annotations

import json

import torch
from transformers import AutoModelForCausalLM

from dsexp.models.writer import ensure_checkpoint

DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=128,
    max_position_embeddings=64,
)


def test_writes_once_then_hits_cache(tmp_path):
    a = ensure_checkpoint(str(tmp_path), "t", "llama", DIMS, "bf16", "safetensors", shard_mb=0.01)
    assert not a.cache_hit and a.bytes > 0
    idx = json.loads((a.path / "model.safetensors.index.json").read_text())
    assert len(set(idx["weight_map"].values())) > 1  # sharded
    b = ensure_checkpoint(str(tmp_path), "t", "llama", DIMS, "bf16", "safetensors", shard_mb=0.01)
    assert b.cache_hit and b.path == a.path


def test_loadable_with_exact_shapes_and_deterministic(tmp_path):
    st = ensure_checkpoint(str(tmp_path), "t", "llama", DIMS, "bf16", "safetensors")
    bn = ensure_checkpoint(str(tmp_path), "t", "llama", DIMS, "bf16", "bin")
    assert st.path != bn.path and list(bn.path.glob("*.bin"))
    m1 = AutoModelForCausalLM.from_pretrained(st.path, dtype=torch.bfloat16)
    m2 = AutoModelForCausalLM.from_pretrained(bn.path, dtype=torch.bfloat16, use_safetensors=False)
    assert m1.model.layers[0].self_attn.k_proj.weight.shape == (2 * 16, 64)
    assert m1.lm_head.weight.shape == (128, 64)
    for (n1, p1), (n2, p2) in zip(m1.state_dict().items(), m2.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)
    assert torch.all(m1.model.norm.weight == 1)
