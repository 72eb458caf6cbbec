"""Architectures the checkpoint writer knows: how to build an HF config from an architecture name and dims.

Three ways to name one: a dsexp preset (`llama`, `internlm2`: their own defaults and, for InternLM2, the remote
code dsexp ships), any transformers `model_type` (`mistral`, `qwen2_moe`, `phi3`, `gpt_neox`, ...: built by
`AutoConfig.for_model(arch, **dims)`) or causal-LM architecture class (`MistralForCausalLM`), or a folder
holding a config.json (and any remote code `*.py`), read by `AutoConfig.from_pretrained` with `dims` on top.
The writer then draws random weights at those exact shapes.
"""

from __future__ import annotations

import difflib
import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

from dsexp.core.schema import TORCH_DTYPE_NAMES


@dataclass(frozen=True)
class Arch:
    make_config: Callable[[Dict[str, Any], str], Any]  # (dims, dtype name) -> transformers config
    remote_code: bool = False  # loads through trust_remote_code
    code_digest: Optional[Callable[[], str]] = None  # version of the shipped modeling code (part of the cache key)
    sets: tuple = ("dtype",)  # config keys the preset sets itself (model.dtype gives the dtype): not model.dims'


def _llama_config(dims: Dict[str, Any], dtype: str):
    from transformers import LlamaConfig

    return LlamaConfig(**dims, dtype=TORCH_DTYPE_NAMES[dtype], tie_word_embeddings=False)


def clashes(arch: Optional[str], dims: Dict[str, Any]) -> List[str]:
    """The keys of model.dims that the preset `arch` sets itself (its config would get them twice)."""
    return [k for k in ARCHS[arch].sets if k in dims] if arch in ARCHS else []


def _internlm2_config(dims: Dict[str, Any], dtype: str):
    from dsexp.models.internlm2 import make_config

    return make_config(dims, TORCH_DTYPE_NAMES[dtype])


def _internlm2_code_digest() -> str:
    from dsexp.models.internlm2 import code_digest

    return code_digest()


ARCHS: Dict[str, Arch] = {
    "llama": Arch(_llama_config, sets=("dtype", "tie_word_embeddings")),
    "internlm2": Arch(_internlm2_config, remote_code=True, code_digest=_internlm2_code_digest),
}


def torch_dtype(name: str):
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES[name])


def transformers_model_types() -> List[str]:
    """Every `model_type` this transformers can build a config for."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return sorted(CONFIG_MAPPING_NAMES)


def causal_lm_classes() -> Dict[str, str]:
    """{architecture class name (as config.json's `architectures` lists it): model_type} for causal LMs."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return {cls: mt for mt, cls in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.items()}


def model_type(arch: str) -> str:
    """A dsexp preset or model_type as is; an architecture class name (MistralForCausalLM) as its model_type."""
    if arch in ARCHS or arch in transformers_model_types():
        return arch
    return causal_lm_classes().get(arch, arch)


def arch_problem(arch: str) -> Optional[str]:
    """Why `arch` names no architecture (with the closest names), or None if it does."""
    types = transformers_model_types()
    if model_type(arch) in ARCHS or model_type(arch) in types:
        return None
    close = difflib.get_close_matches(arch, sorted(set(types) | set(ARCHS) | set(causal_lm_classes())), n=5, cutoff=0.6)
    hint = f"; close matches: {', '.join(close)}" if close else ""
    return (
        f"{arch!r} is neither a dsexp preset ({', '.join(ARCHS)}), a transformers model_type nor a causal-LM "
        f"architecture class{hint}"
    )


# --- config folders (config.json + optional remote code) ----------------------------------------


def code_files(config_path: str) -> List[Path]:
    """The remote-code modules a config folder ships (copied next to every checkpoint written from it)."""
    return sorted(p for p in Path(config_path).expanduser().glob("*.py") if p.is_file())


def folder_ships_code(config_path: str) -> bool:
    from dsexp.core.checkpoint import folder_config

    return bool(folder_config(Path(config_path)).get("auto_map"))


def folder_digest(config_path: str) -> str:
    """Changes whenever config.json or a code file of the folder does (part of the checkpoint's cache key)."""
    folder = Path(config_path).expanduser()
    h = hashlib.sha1()
    for p in [folder / "config.json", *code_files(config_path)]:
        h.update(p.name.encode())
        h.update(p.read_bytes())
    return h.hexdigest()[:12]


# --- one entry point --------------------------------------------------------------------------


def remote_code(arch: Optional[str], config_path: Optional[str] = None) -> bool:
    """Whether the model loads through trust_remote_code."""
    if config_path:
        return folder_ships_code(config_path)
    return bool(arch in ARCHS and ARCHS[arch].remote_code)


def code_digest(arch: Optional[str], config_path: Optional[str] = None) -> Optional[str]:
    """What besides arch and dims decides the model: the config folder's content, or a preset's shipped code."""
    if config_path:
        return folder_digest(config_path)
    if arch in ARCHS and ARCHS[arch].code_digest:
        return ARCHS[arch].code_digest()
    return None


def make_config(
    arch: Optional[str],
    dims: Dict[str, Any],
    dtype: str,
    config_path: Optional[str] = None,
    trust_remote_code: bool = False,
):
    """The transformers config: the folder's config.json with dims on top, a dsexp preset, or
    `AutoConfig.for_model(arch, **dims)` for any transformers model_type."""
    from transformers import AutoConfig

    if config_path:
        cfg = AutoConfig.from_pretrained(str(Path(config_path).expanduser()), trust_remote_code=trust_remote_code)
        for k, v in dims.items():
            setattr(cfg, k, v)
    elif arch in ARCHS:
        return ARCHS[arch].make_config(dims, dtype)
    else:
        cfg = AutoConfig.for_model(model_type(arch), **dims)
    cfg.dtype = TORCH_DTYPE_NAMES[dtype]
    return cfg


def config_summary(cfg) -> Dict[str, Any]:
    """The numbers validation checks (heads, KV heads, hidden size), read through the config's attribute map."""
    text = getattr(cfg, "text_config", None) or cfg
    heads = getattr(text, "num_attention_heads", None)
    kv = getattr(text, "num_key_value_heads", None)
    return {
        "model_type": getattr(cfg, "model_type", None),
        "hidden_size": getattr(text, "hidden_size", None),
        "num_attention_heads": heads,
        "num_key_value_heads": kv or heads,
        "tp_plan": bool(getattr(text, "base_model_tp_plan", None)),
    }
