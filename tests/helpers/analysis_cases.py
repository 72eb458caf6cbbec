"""Constructed result dicts for the analysis tests: the shape of a real result.json (config, runtime, rank
records with phases and census, metrics and headline aggregated by dsexp.records), with chosen numbers."""

from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Sequence

import torch
import torch.nn as nn

from dsexp.core import records

MIB, GIB = 2**20, 2**30
TINY = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=1024,
    max_position_embeddings=512,
    rope_theta=10000.0,
)
# conf/model/internlm2_tiny.yaml's dims: 8 heads over 4 KV heads, so tp=4 keeps a KV head per rank
INTERNLM2_TINY = {**TINY, "num_attention_heads": 8, "num_key_value_heads": 4}
# ~450 M params: large enough (>= 256 MiB) for the host-memory rules; built on the meta device only.
MEDIUM = dict(
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=16,
    num_attention_heads=16,
    num_key_value_heads=8,
    vocab_size=32000,
    max_position_embeddings=2048,
    rope_theta=10000.0,
)


def config(
    tp: int = 1,
    dims: Dict[str, Any] = TINY,
    name: str = "tiny",
    dtype: str = "bf16",
    model_dtype: str = "bf16",
    engine: str = "init_inference",
    kernel_inject: bool = False,
    load: str = "eager",
    fmt: str = "safetensors",
    zero: str = "none",
    stage: int = 0,
    offload: str = "none",
    device: str = "cpu",
    variant: Optional[str] = None,
) -> Dict[str, Any]:
    return {
        "model": {
            "name": name,
            "arch": "llama",
            "path": None,
            "dtype": model_dtype,
            "trust_remote_code": False,
            "shard_mb": 2.0,
            "seed": 0,
            "injection_policy": None,
            "dims": dict(dims),
        },
        "load": {"name": load, "format": fmt, "shard_dir": None},
        "engine": {
            "name": engine,
            "kernel_inject": kernel_inject,
            "injection_policy": "auto",
            "max_out_tokens": 1024,
            "replace_method": None,
            "keep_module_on_host": False,
        },
        "zero": {"name": zero, "stage": stage, "offload": offload, "extra": {}},
        "generate": {"prompt": "what is deepspeed?", "new_tokens": 16},
        "tp": tp,
        "dtype": dtype,
        "device": device,
        "variant": variant,
    }


def result(
    cfg: Dict[str, Any],
    weights: Sequence[int],
    *,
    anon_growth: int = 0,
    rss_growth: Optional[int] = None,
    status: str = "ok",
    passed: Optional[bool] = True,
    rel_err: float = 5e-3,
    failure: Optional[dict] = None,
    modules: Optional[dict] = None,
    unread: Sequence[str] = (),
    on_meta: Sequence[str] = (),
    buffers: Sequence[int] = (128, 128),
    gpu_start: Optional[int] = None,
    gpu_peak: Optional[int] = None,
    node: Sequence[int] = (4 * GIB, 5 * GIB),
    host_start: int = 400 * MIB,
    job: str = "0",
    engine_extra: Optional[dict] = None,
) -> Dict[str, Any]:
    """One run's result dict; `weights` are the measured device bytes per rank after init."""
    dev = "cuda" if cfg["device"] == "cuda" else "cpu"
    ranks = [
        _rank(r, len(weights), w, dev, anon_growth, rss_growth, on_meta, buffers, gpu_start, gpu_peak, node, host_start)
        for r, w in enumerate(weights)
    ]
    metrics = records.aggregate_metrics(ranks)
    res = {
        "schema": 1,
        "key": f"k-{job}",
        "job_dir": f"/sweep/{job}",
        "config": copy.deepcopy(cfg),
        "status": status,
        "runtime": {"device": cfg["device"], "model_dir": None},
        "baseline": {"node_used": node[0]},
        "ranks": ranks,
        "metrics": metrics,
        "headline": records.headline(metrics, ranks, cfg["generate"]["new_tokens"]),
        "engine": {
            "modules": modules if modules is not None else {"removed": {}, "added": {}},
            "unread_fields": list(unread),
            **(engine_extra or {}),
        },
        "correctness": None
        if passed is None
        else {
            "logits_rel_err": rel_err,
            "tolerance": 1e-2,
            "passed": passed,
            "token_agreement": 1.0 if passed else 0.25,
        },
        "failure": failure,
    }
    return res


def _rank(r, world, w, dev, anon_growth, rss_growth, on_meta, buffers, gpu_start, gpu_peak, node, host_start):
    rss_growth = anon_growth if rss_growth is None else rss_growth
    start_host = {
        "host_rss": host_start,
        "host_anon": host_start // 2,
        "host_file": host_start // 2,
        "node_used": node[0],
    }
    peaks = {
        "host_rss_peak": host_start + rss_growth,
        "host_anon_peak": host_start // 2 + anon_growth,
        "node_used_peak": node[1],
    }

    def census(b):
        return {"param_bytes": {dev: w - b}, "buffer_bytes": {dev: b}, "on_meta": list(on_meta), "module_classes": {}}

    phases = {
        "start": {
            "wall_s": 5.0,
            "host": start_host,
            "peaks": dict(start_host, host_rss_peak=host_start, host_anon_peak=host_start // 2),
        },
        "load": {"wall_s": 2.0, "host": dict(start_host), "peaks": peaks, "weights": census(buffers[0])},
        "init": {
            "wall_s": 0.5,
            "host": dict(start_host),
            "peaks": dict(peaks),
            "weights_device": w,
            "weights": census(buffers[1]),
        },
        "generate": {"wall_s": 1.0, "host": dict(start_host), "peaks": dict(peaks)},
    }
    if gpu_start is not None:
        phases["start"]["gpu"] = {"nvml_device_used": gpu_start}
        phases["generate"]["peaks"]["nvml_device_used_peak"] = gpu_peak
    t, timeline = 0.0, []
    for ph in (p for p in records.PHASES if p in phases):  # no quant member: no quantize phase
        timeline.append({"phase": ph, "t0": t, "t1": t + phases[ph]["wall_s"]})
        t += phases[ph]["wall_s"] + 0.1
    return {
        "rank": r,
        "world_size": world,
        "device": dev,
        "status": "ok",
        "phases": phases,
        "timeline": timeline,
        "generate": {"prompt_ids": list(range(18)), "tokens": list(range(16))},
        "error": None,
    }


# --- an InternLM2-layout module (names and shapes only) for placement rules --------------------


class _RMS(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(h))


class InternLM2DecoderLayer(nn.Module):
    def __init__(self, h, i, nh, kv):
        super().__init__()
        hd = h // nh
        self.attention = nn.Module()
        self.attention.wqkv = nn.Linear(h, (nh + 2 * kv) * hd, bias=False)
        self.attention.wo = nn.Linear(nh * hd, h, bias=False)
        self.feed_forward = nn.Module()
        self.feed_forward.w1 = nn.Linear(h, i, bias=False)
        self.feed_forward.w3 = nn.Linear(h, i, bias=False)
        self.feed_forward.w2 = nn.Linear(i, h, bias=False)
        self.attention_norm, self.ffn_norm = _RMS(h), _RMS(h)


class InternLM2ForCausalLM(nn.Module):
    """tok_embeddings, layers.N.attention.wqkv/wo, feed_forward.w1/w2/w3, norms, and a head named `output`."""

    def __init__(self, h=256, i=512, layers=2, nh=8, kv=2, vocab=1024):
        super().__init__()
        from transformers import PretrainedConfig

        self.config = PretrainedConfig(
            hidden_size=h, num_attention_heads=nh, num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=vocab
        )
        self.model = nn.Module()
        self.model.tok_embeddings = nn.Embedding(vocab, h)
        self.model.layers = nn.ModuleList(InternLM2DecoderLayer(h, i, nh, kv) for _ in range(layers))
        self.model.norm = _RMS(h)
        self.output = nn.Linear(h, vocab, bias=False)


INTERNLM2_POLICY = {"InternLM2DecoderLayer": ["attention.wo", "feed_forward.w2"]}


def strategy(**kw):
    """A memory-model Strategy: AutoTP through init_inference, bf16, eager, on CPU, with `kw` on top (the engine's
    traits as the registry says)."""
    from dsexp.engines import ENGINES
    from dsexp.predict.placements import Strategy

    base = dict(
        engine="init_inference",
        kernel_inject=False,
        policy=None,
        zero_stage=0,
        offload="none",
        dtype="bf16",
        model_dtype="bf16",
        load="eager",
        fmt="safetensors",
        device="cpu",
        max_out_tokens=0,
        conversion=None,
    )
    merged = {**base, **kw}
    traits = ENGINES.get(merged["engine"])
    merged.setdefault("casts_buffers", bool(traits and traits.casts_buffers))
    merged.setdefault("splits_weights", bool(traits and traits.splits_weights))
    return Strategy(**merged)
