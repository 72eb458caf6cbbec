"""trim.shard_head in the memory model: the head AutoTP splits besides one named lm_head/embed_out (called by
dsexp.engines.init_inference.placement)."""

from __future__ import annotations

from typing import Optional

from dsexp.trims.shard_head import TRAITS


def aliased_head(model, s, tp: int) -> Optional[str]:
    """The head's attribute when the trim aliases it for AutoTP (a top-level nn.Linear, tp > 1, DeepSpeed >= 0.15);
    None otherwise."""
    if not (s.trimmed(TRAITS.key) and tp > 1 and not s.deepspeed_before(0, 15)):
        return None
    return top_level_head(model)


def top_level_head(model) -> Optional[str]:
    """The output head's attribute when it is a top-level nn.Linear (what trim.shard_head can alias)."""
    import torch.nn as nn

    head = model.get_output_embeddings()
    name = next((n for n, m in model._modules.items() if m is head), None) if head is not None else None
    return name if isinstance(head, nn.Linear) else None
