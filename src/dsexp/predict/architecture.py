"""The model a run used, rebuilt from its config alone on the meta device (no weights, no storage).

Building the model on the meta device gives every parameter and buffer with its exact name, shape,
dtype and owning module, for any architecture transformers or the folder's own remote code can
build; per-model constants or hand-written shape formulas would silently drift from the modeling code.
The run's own folder (`runtime.model_dir`, holding config.json) is preferred; when it is not on this
machine (a report read back from MLflow elsewhere), the preset's architecture and dims rebuild it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}


@dataclass(frozen=True)
class Dims:
    """The architecture numbers the KV cache depends on, and those the activations above the weights depend on
    (predict.capacity)."""

    layers: int
    kv_heads: int
    head_dim: int
    hidden: int = 0
    intermediate: int = 0
    heads: int = 0
    vocab: int = 0
    attention: str = "sdpa"  # the attention the model's code runs (config._attn_implementation): eager holds scores
    model_type: str = ""  # the config's model_type: whose decoder code allocates the activations (predict.capacity)
    full_logits: bool = False  # generate's prefill computes the logits at every position (drops_logits_to_keep)


def model_source(config: Dict[str, Any], runtime: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """What identifies the model: its folder if present here, else the preset's arch and dims."""
    model = config.get("model") or {}
    folder = (runtime or {}).get("model_dir") or model.get("path")
    if folder and (Path(folder) / "config.json").is_file():
        return {"folder": str(folder), "trust_remote_code": bool(model.get("trust_remote_code"))}
    if model.get("config_path") and (Path(model["config_path"]).expanduser() / "config.json").is_file():
        return {
            "arch": model.get("arch"),
            "dims": model.get("dims") or {},
            "config_path": str(Path(model["config_path"]).expanduser()),
            "trust_remote_code": bool(model.get("trust_remote_code")),
        }
    if model.get("arch") and not model.get("path"):
        return {"arch": model["arch"], "dims": model.get("dims") or {}}
    raise LookupError(f"model {model.get('name')!r}: neither its folder ({folder}) nor arch+dims are available")


def meta_model(source: Dict[str, Any], dtype: str):
    """The model on the meta device, parameters in `dtype` (as from_pretrained(dtype=...) makes them)."""
    return _build(json.dumps(source, sort_keys=True), dtype)


@functools.lru_cache(maxsize=16)
def _build(source_json: str, dtype: str):
    return _construct(json.loads(source_json), dtype, real_buffers=False)


def _construct(source: Dict[str, Any], dtype: str, real_buffers: bool):
    """The model of this source with its parameters on meta; its buffers on meta too, or computed for real."""
    import torch

    from dsexp.models.presets import torch_dtype

    if "arch" in source:
        from dsexp.models.writer import meta_model as preset_meta_model

        return preset_meta_model(
            source["arch"],
            source["dims"],
            dtype,
            source.get("config_path"),
            source.get("trust_remote_code", False),
            real_buffers=real_buffers,
        )[1]
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    trust = source["trust_remote_code"]
    cfg = AutoConfig.from_pretrained(source["folder"], trust_remote_code=trust)
    place = init_empty_weights(include_buffers=False) if real_buffers else torch.device("meta")
    with place:
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust, dtype=torch_dtype(dtype))


def model_with_buffers(source: Dict[str, Any], dtype: str):
    """The model with real buffers (computed as the model computes them) and its parameters on the meta device: what
    trim.dedupe_buffers compares (dsexp.trims.dedupe_buffers.placement)."""
    return _construct(source, dtype, real_buffers=True)


def dims(model) -> Dims:
    cfg = model.config
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = cfg.num_attention_heads
    kv = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return Dims(
        layers=cfg.num_hidden_layers,
        kv_heads=kv,
        head_dim=head_dim,
        hidden=cfg.hidden_size,
        intermediate=getattr(cfg, "intermediate_size", None) or 4 * cfg.hidden_size,
        heads=heads,
        vocab=cfg.vocab_size,
        attention=getattr(model.config, "_attn_implementation", None) or "eager",
        model_type=getattr(cfg, "model_type", "") or "",
        full_logits=drops_logits_to_keep(model),
    )


def drops_logits_to_keep(model) -> bool:
    """Whether the model's own prepare_inputs_for_generation drops generate's `logits_to_keep` (InternLM2's published
    code builds its inputs itself): its prefill then computes the logits at every prompt position, not the last only.
    Asked of the method with a two-token prompt (no forward runs); a method that refuses it counts as keeping it."""
    import torch

    ids = torch.zeros((1, 2), dtype=torch.long)
    try:
        inputs = model.prepare_inputs_for_generation(
            ids, attention_mask=torch.ones_like(ids), logits_to_keep=1, use_cache=True
        )
    except Exception:
        return False
    return "logits_to_keep" not in inputs


def checkpoint_files(folder: Optional[str]) -> Dict[str, int]:
    """{file name: bytes} of the weight files in a model folder (empty if the folder is not here)."""
    if not folder or not Path(folder).is_dir():
        return {}
    return {
        p.name: p.stat().st_size
        for p in sorted(Path(folder).iterdir())
        if p.suffix in (".safetensors", ".bin") and p.is_file()
    }
