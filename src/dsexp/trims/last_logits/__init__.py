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

from dsexp.trims.base import TrimTraits

TRAITS = TrimTraits(
    "last_logits",
    short="logits",
    summary="in generate, the head computes the last position's logits only (a model whose code drops logits_to_keep)",
    last_position_logits=True,
)
