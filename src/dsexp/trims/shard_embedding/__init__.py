"""trim.shard_embedding: DeepSpeed's VocabParallelEmbedding for the input embedding (module_inject/layers.py;
vocabulary rows split, lookups outside a rank's rows zeroed, partial results all-reduced), which AutoTP inference
never applies itself.

rank.py builds it before `init_inference` when the weights are on the host or on meta without a DeepSpeed
checkpoint (the full table never reaches the device), after it when DeepSpeed fills the model from `checkpoint=`
(DeepSpeed's loader fills nn.Embedding only), moving the full table off the device first. placement.py: the
embedding it splits.
"""

from __future__ import annotations

from dsexp.core.gates import VersionGate
from dsexp.trims.base import TrimTraits

TRAITS = TrimTraits(
    "shard_embedding",
    short="emb",
    summary="init_inference AutoTP: DeepSpeed's VocabParallelEmbedding for the input embedding",
    autotp_only=True,
    changes_slices=True,
    gate=VersionGate("deepspeed", "0.19.8", "DeepSpeed's VocabParallelEmbedding is not in 0.14.4 (measured in 0.19.8)"),
)
