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


def test_a_checkpoint_the_disk_cannot_hold_is_refused_before_it_is_written_naming_the_cached_ones(
    tmp_path, monkeypatch
):
    """The H200's 64 GiB disk held one 20B checkpoint and failed 20 GiB into the next: now the write is refused at
    once, with both numbers and the checkpoints cached beside it, and no half-written folder is left."""
    import shutil
    from collections import namedtuple

    import pytest

    from dsexp.models import writer

    first = ensure_checkpoint(str(tmp_path), "first", "llama", DIMS, "bf16", "safetensors")
    Usage = namedtuple("Usage", "total used free")
    monkeypatch.setattr(writer.shutil, "disk_usage", lambda p: Usage(10 * 2**30, 10 * 2**30 - 2**20, 2**20))
    with pytest.raises(writer.NoSpaceError) as e:
        ensure_checkpoint(str(tmp_path), "second", "llama", DIMS, "fp32", "safetensors")
    msg = str(e.value)
    assert "has 0.00 GiB free" in msg and f"cached there: {first.path}" in msg and "cache_dir" in msg
    monkeypatch.setattr(writer.shutil, "disk_usage", shutil.disk_usage)
    assert sorted(p.name for p in (tmp_path / "models").iterdir() if p.is_dir()) == [first.path.name]
