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
from typing import Dict, List, Optional, Tuple

from dsexp.predict.architecture import DTYPE_BYTES
from dsexp.predict.placements import Placement, Strategy
from dsexp.quant import traits
from dsexp.quant.base import QuantTraits
from dsexp.quant.on_meta import quantize_temporaries


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


def head_weight(model) -> Optional[str]:
    """The output head's weight name in the meta model (None where it names none)."""
    from dsexp.quant.torchao_rank import output_head

    head = output_head(model)
    return next((f"{n}.weight" if n else "weight" for n, m in model.named_modules() if m is head), None)


def quantize(model, placements: List[Placement], s: Strategy, tp: int, notes: List[str]) -> List[Placement]:
    """The placements with the member's weights at their stored bytes (unchanged without a member)."""
    if s.kv_bits:
        notes.append(kv_rule(s))
    t = traits(s.quant or "none")
    if t is None:
        return placements
    shapes = quantized_weights(model, t, s.quant_head)
    rule = rule_of(t)
    # AutoTP's clone of a tied head (`copy`) is the head quantize_ sees, with quant.head: quantized like the head
    out = [rule(p, shapes[p.name], t, s, tp) if p.name in shapes else p for p in placements]
    head = head_weight(model)
    placements, out = _untied_head(head, placements, out, shapes, t, s, tp)
    if s.quant_head_first and s.quant_empty_cache == "each":
        out = [replace(p, first=True) if p.name == head else p for p in out]
    notes.append(weight_rule(t, s, len(shapes)) + _left_whole(model, t))
    if t.library == "torchao":
        temporaries = {n: quantize_temporaries(t.key, s.quant_group, *shape) for n, shape in shapes.items()}
        notes.append(load_peak(placements, out, shapes, temporaries))
        if str(s.device).startswith("cuda"):  # a CPU run has no caching allocator
            notes.append(LEFT_IN_CACHE[s.quant_empty_cache])
    return out


def _left_whole(model, t: QuantTraits) -> str:
    """What torchao's filter passes over that a user would expect quantized: a mixture of experts' weights held as
    3-D parameters (transformers 5's fused experts, Mixtral's gate_up_proj and down_proj), not nn.Linear layers."""
    import re

    if t.library != "torchao":
        return ""
    fused = [n for n, p in model.named_parameters() if p.dim() >= 3]
    if not fused:
        return ""
    families = sorted({re.sub(r"\.\d+\.", ".*.", n) for n in fused})
    size = sum(p.numel() * p.element_size() for _, p in model.named_parameters() if p.dim() >= 3)
    return (
        f"; also in the run dtype: {', '.join(families)} ({_gib_or_mib(size)}, fused experts held as 3-D "
        "parameters, not the nn.Linear layers torchao's quantize_ takes)"
    )


def _gib_or_mib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"


def _untied_head(head: Optional[str], placements, out, shapes, t: QuantTraits, s: Strategy, tp: int):
    """A head tied to the embedding, where no engine cloned it (tp=1): quantize_ gives the head a weight of its own,
    the embedding staying in the run dtype (tiny_qwen2_tied with quant.head at tp=1: 34,048 B more than the model
    counted). Added to both lists, with no run-dtype bytes of its own before (they are the embedding's)."""
    if not (s.quant_head and head in shapes) or any(p.name == head for p in placements):
        return placements, out
    rows, cols = shapes[head]
    whole = rows * cols * DTYPE_BYTES[s.dtype]
    untied = Placement(head, whole, (whole,) * tp, "replicated", copy=True)
    before = replace(untied, full=0, local=(0,) * tp)
    return [*placements, before], [*out, rule_of(t)(untied, shapes[head], t, s, tp)]


def rule_of(t: QuantTraits):
    """How the member stores a weight: DeepSpeed's flat partitions, or torchao's tensors on each rank."""
    return _zero3_bytes if t.library == "deepspeed" else _linear_bytes


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


def load_peak(
    before: List[Placement],
    after: List[Placement],
    shapes: Dict[str, Tuple[int, int]],
    temporaries: Optional[Dict[str, Optional[int]]] = None,
) -> str:
    """The busiest rank's device at the load, by order: `stream` walks the weights as they arrive, each quantized but
    the one being quantized, held in the run dtype with what its quantize holds beside it (`temporaries`, traced on
    the meta device for the whole weight: a rank's share in proportion to its bytes); its peak is the largest such
    moment, or all the weights quantized. At tp > 1 they arrive in the model's order (AutoTP's init put the
    embedding's shard on the device first); at tp=1 the linears first, the rest after them. A weight quantized first
    (`first`: the head with quant.head_first) comes before the other linears. On the H100: int4 at
    tp=2 with the head quantized (the last linear, its tinygemm packing five times its bf16 shard) 8.35 GiB, as
    measured; without the head 5.70 against 5.77; at tp=1 fp8 19.57 against 19.566, int8 19.57 against 19.569,
    int4 11.38 against 11.417. `after` holds the weights in the run dtype and the largest linear quantized beside
    them (its new tensors made before the old ones go)."""
    tp = len(before[0].local) if before else 1
    temporaries = temporaries or {}
    pairs = list(zip(before, after))
    if tp == 1:  # nothing on the device before the quantize: quantize_each moves the rest after the linears
        pairs.sort(key=lambda pair: pair[0].name not in shapes)
    firsts = [pair for pair in pairs if pair[1].first]
    if firsts:  # before the first linear: what AutoTP's init placed before it stays there
        rest = [pair for pair in pairs if not pair[1].first]
        at = next((i for i, (b, _) in enumerate(rest) if b.name in shapes), len(rest))
        pairs = [*rest[:at], *firsts, *rest[at:]]
    rows = []
    for r in range(tp):
        held, stream = 0, 0
        for b, a in pairs:
            if b.name in shapes:
                stream = max(stream, held + b.local[r] + _share(temporaries.get(b.name), b.local[r], shapes[b.name]))
            held += a.local[r]
        full_run = sum(b.local[r] for b in before)
        largest_q = max((a.local[r] for b, a in zip(before, after) if b.name in shapes), default=0)
        rows.append((max(stream, held), full_run + largest_q))
    stream, after_peak = max(x for x, _ in rows), max(y for _, y in rows)
    return (
        f"quant load peak on the busiest device: stream {stream / 2**30:.2f} GiB (the weights arriving in order, "
        f"quantized, one in the run dtype with its quantize's temporaries), after {after_peak / 2**30:.2f} GiB (the "
        "unquantized weights and the largest linear quantized beside them)"
    )


def _share(whole: Optional[int], local: int, shape: Tuple[int, int]) -> int:
    """A rank's part of the temporaries traced for the whole weight: in proportion to its bf16 bytes."""
    if not whole:
        return 0
    return int(whole * local / (2 * shape[0] * shape[1]))


DEQUANTIZES = {
    "layer": "each forward dequantizes one weight at a time to the run dtype",
    "gathered": "each forward gathers a whole weight and dequantizes it",
}


FORWARDS = {  # a forward that dequantizes no weight (QuantTraits.forward)
    "fp8": "the products run in fp8, each input quantized on the fly (`act fp8`): no weight is dequantized",
    "packed": "tinygemm's kernel reads the packed weight: no weight is dequantized",
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
    deq = DEQUANTIZES.get(s.dequantizes or "") or FORWARDS.get(t.forward, "")
    return (
        f"quant={t.key}: {weights} weights at {st.bits / 8:g} B per element + {scale} per {per}; {kept} stay in "
        f"{s.dtype}; {deq}" + (" (`dequant`)" if s.dequantizes else "")
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
    return replace(
        p, full=full, local=tuple(sum(x) for x in parts), parts=tuple(parts), run_local=p.local, run_full=p.full
    )


def _zero3_bytes(p: Placement, shape: Tuple[int, int], t: QuantTraits, s: Strategy, tp: int) -> Placement:
    """A weight as DeepSpeed's quantized initialization stores it: one flat tensor of the run dtype (packed values,
    then per group a scale and a minimum), partitioned ceil(elements / tp) a rank (or on the host, offloaded)."""
    e = _itemsize(p, shape)
    flat = t.storage.nbytes(shape[0], shape[1], e, s.quant_group) // e
    part = math.ceil(flat / tp) * e
    return replace(p, full=flat * e, local=tuple(part if b else 0 for b in p.local), run_local=p.local, run_full=p.full)
