"""trim.last_logits on a rank: the output head keeps the last position of its input (imported on ranks only)."""

from __future__ import annotations

from typing import Any, Dict


def keep_last_logits(module) -> Dict[str, Any]:
    """Hook the output head (the model's get_output_embeddings, whatever the engine replaced it with) so that a call
    over several positions computes the last one's logits only. The report counts the calls it cut as they happen:
    0 where the model's code already gives the head the last position only (transformers' own models)."""
    model = getattr(module, "module", module)  # DeepSpeed's InferenceEngine holds the model as .module
    get_head = getattr(model, "get_output_embeddings", None)
    head = get_head() if get_head else None
    if head is None:
        return {"applied": False, "why": f"{type(model).__name__} names no output head (get_output_embeddings)"}
    report: Dict[str, Any] = {"applied": True, "head": type(head).__name__, "calls_cut": 0}

    def last_position(_head, args):
        hidden = args[0]
        if hidden.dim() != 3 or hidden.shape[1] == 1:
            return None
        report["calls_cut"] += 1
        return (hidden[:, -1:, :], *args[1:])

    head.register_forward_pre_hook(last_position)
    return report
