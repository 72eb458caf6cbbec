"""trim.shard_head on a rank: the head aliased as `lm_head` around `init_inference` (dsexp.engines.init_inference)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from dsexp.trims.rank import nbytes
from dsexp.trims.shard_head import HEAD_NAMES


def head_attr(model) -> str:
    """The top-level attribute holding the output head (DeepSpeed's set_lm_head only looks at top-level ones)."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model._modules.items() if m is head), None) if head is not None else None
    if name is None:
        raise RuntimeError(
            "trim.shard_head: the model's output head is not a top-level module "
            f"({type(head).__name__ if head is not None else 'none'}); DeepSpeed's set_lm_head only splits "
            "model.lm_head / model.embed_out"
        )
    return name


def alias_head(model) -> Tuple[Optional[str], Dict[str, Any]]:
    """Before init_inference: register the head also as `lm_head`. Returns (attribute aliased or None, report)."""
    import torch.nn as nn

    attr = head_attr(model)
    head = model._modules[attr]
    report: Dict[str, Any] = {"module": attr, "bytes_before": sum(nbytes(p) for p in head.parameters())}
    if attr in HEAD_NAMES:
        return None, {**report, "skipped": f"named {attr}: DeepSpeed's AutoTP splits it without the trim"}
    if not isinstance(head, nn.Linear):
        raise RuntimeError(f"trim.shard_head: the output head {attr} is {type(head).__name__}, not nn.Linear")
    if any(n in model._modules for n in HEAD_NAMES):
        raise RuntimeError(f"trim.shard_head: the model already has a module named {HEAD_NAMES}, besides {attr}")
    model._modules["lm_head"] = head
    return attr, report


def unalias_head(module, attr: str, report: Dict[str, Any]) -> Dict[str, Any]:
    """After init_inference: DeepSpeed's replacement goes back under the head's own name, the alias goes."""
    new = module._modules.pop("lm_head")
    module._modules[attr] = new
    local = [p.to_local() if hasattr(p, "to_local") else p for p in new.parameters()]
    return {
        **report,
        "replaced_by": type(new).__name__,
        "bytes_after": sum(nbytes(p) for p in local if not p.is_meta),
        "shape_after": [list(p.shape) for p in local],
        "how": "aliased as lm_head during init_inference (DeepSpeed's set_lm_head)",
    }
