"""`from_pretrained` on every rank, as the seed does (safetensors are mmap'd; a dtype change copies)."""

from __future__ import annotations

from typing import Any, Dict

from dsexp.core.compat import dtype_kwargs
from dsexp.core.context import RankContext
from dsexp.rank.faults import poison_buffers
from dsexp.rank.loading import buffers
from dsexp.rank.loading.base import Loaded, Loader


def from_pretrained(ctx: RankContext, **kwargs: Any):
    from transformers import AutoModelForCausalLM

    if "dtype" not in kwargs and "torch_dtype" not in kwargs:
        kwargs.update(dtype_kwargs(ctx.torch_dtype))
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
        poison_buffers(ctx.spec.fault, ctx.rank, model)  # test-only: buffers as transformers >= 5 may leave them
        recompute = ctx.spec.load.restore_buffers
        originals, report = buffers.after_load(model, ctx, recompute)
        # without recompute nothing is put back after the engine either (and the as-loaded tensors are not held)
        finalize = buffers.restoring(ctx, originals) if recompute else None
        return Loaded(model, finalize=finalize, info={"buffers": report})
