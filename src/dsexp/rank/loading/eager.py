"""`from_pretrained` on every rank, as the seed does (safetensors are mmap'd; a dtype change copies)."""

from __future__ import annotations

from typing import Any, Dict

from dsexp.rank.context import RankContext
from dsexp.rank.loading import buffers
from dsexp.rank.loading.base import Loaded, Loader


def from_pretrained(ctx: RankContext, **kwargs: Any):
    from transformers import AutoModelForCausalLM

    kwargs.setdefault("dtype", ctx.torch_dtype)
    return AutoModelForCausalLM.from_pretrained(
        str(ctx.model_dir),
        trust_remote_code=ctx.spec.model.trust_remote_code,
        use_safetensors=ctx.spec.load.format == "safetensors",
        **kwargs,
    )


class EagerLoader(Loader):
    name = "eager"

    def load(self, ctx: RankContext, hf_kwargs: Dict[str, Any]) -> Loaded:
        model = from_pretrained(ctx, **hf_kwargs).eval()
        if not ctx.spec.load.restore_buffers:
            return Loaded(model)
        return Loaded(model, finalize=buffers.restoring(ctx, buffers.snapshot(model)))
