"""trim.shard_embedding in the memory model: the input embedding AutoTP's VocabParallelEmbedding splits (called by
dsexp.engines.init_inference.placement)."""

from __future__ import annotations

from typing import Optional

from dsexp.trims.shard_embedding import TRAITS


def embedding_to_split(model, s, tp: int) -> Optional[str]:
    """The input embedding's module name when the trim splits it (tp > 1); None otherwise."""
    return input_embedding(model) if s.trimmed(TRAITS.key) and tp > 1 else None


def input_embedding(model) -> Optional[str]:
    """The input embedding's module name when it is a plain nn.Embedding (what VocabParallelEmbedding accepts)."""
    import torch.nn as nn

    emb = model.get_input_embeddings()
    if type(emb) is not nn.Embedding:
        return None
    return next(n for n, m in model.named_modules() if m is emb)
