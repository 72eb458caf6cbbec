"""The KV cache per rank: 2 x layers x the KV heads the rank holds x head_dim x tokens x bytes."""

from __future__ import annotations

from dsexp.predict import architecture as arch


def kv_heads(kv: int, tp: int, rank: int, splits_weights: bool) -> int:
    """KV heads a rank holds: its share where the engine splits the heads (one each, replicated, once tp exceeds
    them: a rank needs at least one), all of them otherwise."""
    if not splits_weights or tp == 1:
        return kv
    return max(1, kv // tp + (1 if rank < kv % tp else 0))


def kv_bytes(d: arch.Dims, heads: int, tokens: int, dtype: str, batch: int = 1) -> int:
    return 2 * d.layers * heads * d.head_dim * tokens * batch * arch.DTYPE_BYTES[dtype]
