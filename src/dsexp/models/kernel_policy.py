"""Which of a model's layers DeepSpeed's kernel injection would replace, from DeepSpeed's own policy list.

`init_inference(replace_with_kernel_inject=True)` swaps a layer only if its class is the
`_orig_layer_class` of one of `deepspeed.module_inject.replace_policy.replace_policies` (matched by
identity, as `replace_module` does). A model with no such layer is left untouched, silently, and needs
no CUDA op; one with such a layer gets DeepSpeed's fused CUDA kernels.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any, List, Optional, Tuple


@lru_cache(maxsize=1)
def kernel_policy_classes() -> Tuple[type, ...]:
    """Layer classes DeepSpeed has kernel-injection policies for (instantiating each policy fills them in)."""
    from deepspeed.module_inject.replace_policy import replace_policies

    classes = []
    for policy in replace_policies:
        try:
            policy(None)  # what replace_module does to populate _orig_layer_class
        except Exception:  # a policy whose model library is not installed
            continue
        orig = policy._orig_layer_class
        classes.extend(orig if isinstance(orig, list) else [orig] if orig is not None else [])
    return tuple(classes)


def kernel_injected_layers(model) -> List[str]:
    """Names of the model's layer classes that kernel injection would replace (empty: it is a no-op)."""
    policy = set(kernel_policy_classes())
    return sorted({type(m).__name__ for m in model.modules() if type(m) in policy})


def meta_model_of(model: Any):
    """A model group's model (a ModelConfig: its folder, else its preset or config) on the meta device, without
    weights: what validation asks an engine's questions of."""
    if model.path:
        return folder_meta_model(str(Path(model.path).expanduser()), model.trust_remote_code)
    return preset_meta_model(
        model.arch,
        json.dumps(dict(model.dims), sort_keys=True),
        model.dtype,
        model.config_path,
        model.trust_remote_code,
    )


@lru_cache(maxsize=32)
def preset_meta_model(
    arch: Optional[str], dims_json: str, dtype: str, config_path: Optional[str] = None, trust_remote_code: bool = False
):
    """A preset's (or model=config's) model on the meta device (cached: validation asks several questions of it)."""
    from dsexp.models.writer import meta_model

    return meta_model(arch, json.loads(dims_json), dtype, config_path, trust_remote_code)[1]


@lru_cache(maxsize=32)
def folder_meta_model(path: str, trust_remote_code: bool):
    """A model folder's model on the meta device, from its config.json (and remote code)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(cfg, trust_remote_code=trust_remote_code)


def tp_plan(model) -> dict:
    """The model's transformers tensor-parallel plan: its config's base_model_tp_plan and its own _tp_plan."""
    base = getattr(model.config, "base_model_tp_plan", None) or {}
    return {**base, **(getattr(model, "_tp_plan", None) or {})}
