"""The quant members in the memory model: after the engine's rule (and the trims') placed every tensor in the run
dtype, each weight the member quantizes takes its stored bytes on each rank (called by dsexp.engines.placement).

torchao's members quantize the model's nn.Linear weights but the output head's, after the engine: a weight AutoTP
split keeps its cut (rows of a column-parallel layer, columns of a row-parallel one) and is stored at its width with a
scale per row (or group). DeepSpeed's members quantize every nn.Linear and nn.Embedding weight as zero.Init builds it,
into one flat tensor of the run dtype (the packed values, then a scale and a minimum per group), which ZeRO-3 then
partitions like any parameter: ceil(elements / ranks) a rank."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Dict, List, Tuple

from dsexp.predict.placements import Placement, Strategy
from dsexp.quant import traits
from dsexp.quant.base import QuantTraits


def quantized_weights(model, t: QuantTraits, with_head: bool = False) -> Dict[str, Tuple[int, int]]:
    """{weight name: (out, in)} of the weights the member quantizes in the meta model (torchao's: the output head
    only `with_head`)."""
    import torch.nn as nn

    from dsexp.quant.torchao_rank import output_head

    head = output_head(model)
    kinds = (nn.Linear, nn.Embedding) if t.library == "deepspeed" else (nn.Linear,)
    out = {}
    for name, m in model.named_modules():
        if not isinstance(m, kinds) or (t.library == "torchao" and m is head and not with_head):
            continue
        w = getattr(m, "weight", None)
        if w is not None and w.dim() == 2:
            out[f"{name}.weight" if name else "weight"] = tuple(w.shape)
    return out


def quantize(model, placements: List[Placement], s: Strategy, tp: int, notes: List[str]) -> List[Placement]:
    """The placements with the member's weights at their stored bytes (unchanged without a member)."""
    if s.kv_bits:
        notes.append(kv_rule(s))
    t = traits(s.quant or "none")
    if t is None:
        return placements
    shapes = quantized_weights(model, t, s.quant_head)
    rule = _zero3_bytes if t.library == "deepspeed" else _linear_bytes
    out = [rule(p, shapes[p.name], t, s, tp) if p.name in shapes and not p.copy else p for p in placements]
    notes.append(weight_rule(t, s, len(shapes)))
    if t.library == "torchao":
        notes.append(load_peak(placements, out, shapes))
        if str(s.device).startswith("cuda"):  # a CPU run has no caching allocator
            notes.append(LEFT_IN_CACHE[s.quant_empty_cache])
    return out


# What quantizing leaves in the caching allocator, by quant.empty_cache, as the H100 measured it for fp8 at tp=1
# (results/h200/quant/empty_cache): the fix that measured best is the default
LEFT_IN_CACHE = {
    "each": "quant.empty_cache=each: one linear quantized at a time, the cache emptied after each; on the H100, fp8 "
    "left 0.10 GiB cached above 19.57 GiB of weights (a whole-model quantize_, quant.empty_cache=end: 1.24 GiB, "
    "reserved at 22.00 GiB at its peak); the replay places the quantized weights so",
    "end": "quant.empty_cache=end: the bf16 blocks quantizing frees stay cached around the quantized weights (on the "
    "H100, fp8: 1.24 GiB above 19.57), which the batch pays for; the replay records that quantize phase on the meta "
    "device (1.05 GiB there); quant.empty_cache=each (the default) left 0.10 GiB",
}


def load_peak(before: List[Placement], after: List[Placement], shapes: Dict[str, Tuple[int, int]]) -> str:
    """The busiest rank's device at the load, by order: `stream` holds the quantized weights and the largest
    linear in the run dtype (moved, then quantized); `after` holds the weights in the run dtype and the largest
    linear quantized beside them (its new tensors made before the old ones go)."""
    tp = len(before[0].local) if before else 1
    rows = []
    for r in range(tp):
        q = [(b.local[r], a.local[r]) for b, a in zip(before, after) if b.name in shapes]
        full_run = sum(b.local[r] for b in before)
        full_q = sum(a.local[r] for a in after)
        largest_run = max((x for x, _ in q), default=0)
        largest_q = max((y for _, y in q), default=0)
        rows.append((full_q + largest_run, full_run + largest_q))
    stream, after_peak = max(x for x, _ in rows), max(y for _, y in rows)
    return (
        f"quant load peak on the busiest device: stream {stream / 2**30:.2f} GiB (the quantized weights and the "
        f"largest linear unquantized), after {after_peak / 2**30:.2f} GiB (the unquantized weights and the largest "
        "linear quantized beside them)"
    )


DEQUANTIZES = {
    "layer": "each forward dequantizes one weight at a time to the run dtype",
    "gathered": "each forward gathers a whole weight and dequantizes it",
}


def weight_rule(t: QuantTraits, s: Strategy, weights: int) -> str:
    """The member's rule in words: bytes per element and per scale group, what stays in the run dtype, what its
    forward dequantizes."""
    st, group = t.storage, s.quant_group or t.storage.group
    per = f"{group} elements of a row" if group else "row"
    each = f"{st.scale_bytes} B" if st.scale_bytes else f"{s.dtype}"
    scale = f"{st.per_group} x {each}" if st.per_group > 1 else each
    kept = "norms and buffers"
    if t.library == "torchao":
        kept = "embeddings, " + kept if s.quant_head else "the output head, embeddings, " + kept
    deq = DEQUANTIZES.get(s.dequantizes or "", "the products run in fp8: no weight is dequantized")
    return (
        f"quant={t.key}: {weights} weights at {st.bits / 8:g} B per element + {scale} per {per}; {kept} stay in "
        f"{s.dtype}; {deq} (`dequant`)"
    )


def kv_rule(s: Strategy) -> str:
    """quant.kv's rule in words."""
    e = {"fp32": 4, "bf16": 2, "fp16": 2}[s.dtype]
    per = s.kv_bits / 8 + 2 * e / s.kv_group
    return (
        f"quant.kv={s.kv_bits}: the KV cache at {per:g} B per element ({s.kv_bits} bits + a scale and a shift in "
        f"{s.dtype} per {s.kv_group} elements), fewer than {s.kv_residual} newest tokens in {s.dtype}; a decode step "
        "dequantizes one layer's keys and values (`kv deq`)"
    )


def _itemsize(p: Placement, shape: Tuple[int, int]) -> int:
    return max(1, p.full // (shape[0] * shape[1]))


def _linear_bytes(p: Placement, shape: Tuple[int, int], t: QuantTraits, s: Strategy, tp: int) -> Placement:
    """A linear's weight as torchao stores it on each rank: its local rows x columns (AutoTP's cut kept)."""
    out, inp = shape
    e = _itemsize(p, shape)
    parts = []
    for b in p.local:
        rows, cols = (b // (inp * e), inp) if p.dim == 0 else (out, b // (out * e)) if p.dim == 1 else (out, inp)
        parts.append(t.storage.parts(rows, cols, e, s.quant_group) if b else (0, 0))
    full = t.storage.nbytes(out, inp, e, s.quant_group)
    return replace(p, full=full, local=tuple(sum(x) for x in parts), parts=tuple(parts), run_local=p.local)


def _zero3_bytes(p: Placement, shape: Tuple[int, int], t: QuantTraits, s: Strategy, tp: int) -> Placement:
    """A weight as DeepSpeed's quantized initialization stores it: one flat tensor of the run dtype (packed values,
    then per group a scale and a minimum), partitioned ceil(elements / tp) a rank (or on the host, offloaded)."""
    e = _itemsize(p, shape)
    flat = t.storage.nbytes(shape[0], shape[1], e, s.quant_group) // e
    part = math.ceil(flat / tp) * e
    return replace(p, full=flat * e, local=tuple(part if b else 0 for b in p.local), run_local=p.local)
