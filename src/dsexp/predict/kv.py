"""The KV cache per rank: 2 x layers x the KV heads the rank holds x head_dim x tokens x bytes; quantized
(quant.kv, transformers' QuantizedCache: dsexp.quant.kv), the tokens it quantized at their width and the newest ones
in the run dtype."""

from __future__ import annotations

from dataclasses import dataclass

from dsexp.predict import architecture as arch


def kv_heads(kv: int, tp: int, rank: int, splits_weights: bool) -> int:
    """KV heads a rank holds: its share where the engine splits the heads (one each, replicated, once tp exceeds
    them: a rank needs at least one), all of them otherwise."""
    if not splits_weights or tp == 1:
        return kv
    return max(1, kv // tp + (1 if rank < kv % tp else 0))


def kv_bytes(d: arch.Dims, heads: int, tokens: int, dtype: str, batch: int = 1) -> int:
    return 2 * d.layers * heads * d.head_dim * tokens * batch * arch.DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class KVSplit:
    """Tokens of one sequence's cache after a generate: quantized, and kept in the run dtype (the residual)."""

    quantized: int
    residual: int


def split_tokens(prompt: int, new_tokens: int, residual_length: int) -> KVSplit:
    """The prefill quantizes the prompt; each of the new_tokens - 1 decode steps appends one token to the residual,
    which is quantized with the rest once it would reach `residual_length` (transformers' QuantizedLayer.update)."""
    steps = max(0, new_tokens - 1)
    kept = steps % residual_length if residual_length > 0 else 0
    return KVSplit(prompt + steps - kept, kept)


def quantized_bytes(elements: int, bits: int, group: int, dtype_bytes: int) -> int:
    """One quantized key (or value) tensor: packed values and, per group, a scale and a shift in the run dtype.
    quanto packs the values as [groups, group], 8 / bits rows to a byte along the groups, so a count of groups that
    8 / bits does not divide is padded: 2 bits on 18 groups hold 20 (the tiny Llama's cache at tp=2, 128 B a rank
    more than the count without the padding). A tensor of one group it scales per element (64 scales and shifts)."""
    groups = -(-elements // group)
    per_byte = 8 // bits
    packed = -(-groups // per_byte) * group if elements % group == 0 else elements * bits // 8
    scales = group if groups == 1 else groups
    return packed + scales * 2 * dtype_bytes


def cache_bytes(
    layers: int, kv_heads: int, head_dim: int, batch: int, split: KVSplit, bits: int, group: int, dtype_bytes: int
) -> int:
    """The whole cache after a generate: keys and values of every layer, quantized and residual."""
    per_token = batch * kv_heads * head_dim
    quantized = quantized_bytes(per_token * split.quantized, bits, group, dtype_bytes) if split.quantized else 0
    return 2 * layers * (quantized + per_token * split.residual * dtype_bytes)
