"""Architectures the checkpoint writer knows: how to build an HF config for each from preset dims."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional


@dataclass(frozen=True)
class Arch:
    make_config: Callable[[Dict[str, Any], str], Any]  # (dims, dtype name) -> transformers config
    remote_code: bool = False  # loads through trust_remote_code
    code_digest: Optional[Callable[[], str]] = None  # version of the shipped modeling code (part of the cache key)


def _llama_config(dims: Dict[str, Any], dtype: str):
    from transformers import LlamaConfig

    return LlamaConfig(**dims, dtype=TORCH_DTYPE_NAMES[dtype], tie_word_embeddings=False)


def _internlm2_config(dims: Dict[str, Any], dtype: str):
    from dsexp.models.internlm2 import make_config

    return make_config(dims, TORCH_DTYPE_NAMES[dtype])


def _internlm2_code_digest() -> str:
    from dsexp.models.internlm2 import code_digest

    return code_digest()


TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}

ARCHS: Dict[str, Arch] = {
    "llama": Arch(_llama_config),
    "internlm2": Arch(_internlm2_config, remote_code=True, code_digest=_internlm2_code_digest),
}


def torch_dtype(name: str):
    import torch

    return getattr(torch, TORCH_DTYPE_NAMES[name])
