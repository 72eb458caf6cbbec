"""trim.last_logits: in generate, the output head computes the last position's logits only, as transformers'
`logits_to_keep=1` has its own models do. A model whose code drops it (InternLM2 as published builds its own
generation inputs) computes the logits of every prompt position in the prefill, in its dtype and again in fp32: on the
H200 at 20B shapes and 10 x 2048 tokens, 10.59 of the 12.73 GiB above the weights on each rank, and under AutoTP the
logits stay whole on every rank whatever the tp. Generate reads only the last position's, so the first-step logits
and every token are unchanged.

rank.py: a forward pre-hook on the output head that keeps the last position of what it is given. In the memory model
(dsexp.predict.capacity) the trim turns the prefill's logits from B x L x vocab to B x vocab. Not for a forward that
needs every position's logits (a loss over labels, a perplexity): dsexp's own pipeline only generates.
"""

from __future__ import annotations

from typing import Any, Dict

from dsexp.trims.base import TrimTraits

TRAITS = TrimTraits(
    "last_logits",
    short="logits",
    summary="in generate, the head computes the last position's logits only (a model whose code drops logits_to_keep)",
    last_position_logits=True,
)


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
