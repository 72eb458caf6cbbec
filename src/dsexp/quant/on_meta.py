"""A rank's model quantized on the meta device, for the allocator replay to trace its generate (dsexp.predict): the
member's own torchao call (quantize_, the same config and filter as a rank's) on the meta model as the engine leaves
that rank. torchao's quantize and forward are Python over torch's ops, which the meta device runs: the trace records
the fp8 input's quantization (its float32 temporaries), int8's dequantized weight and int4's padded input as the GPU
makes them, where the allocated bytes' formula had a term for each (int4's packing and tinygemm's product have meta
kernels: torch's, and dsexp.predict.meta_trace.int4pack_mm where torch's needs a FakeTensor; at 64 x 2048 tokens the
H100 allocated within 6 MB of the replay and reserved within 0.06 GiB). What the meta device cannot stand in for is
refused, with the reason: DeepSpeed's members quantize inside zero.Init and gather per layer
(ZeRO-3 is not traced); the quantized KV cache's quanto kernels; and quant.order=after (the blocks the run-dtype
weights were loaded in by the engine are not modelled). quant.empty_cache=end is replayed as its quantize phase ran:
each linear moved in the run dtype, quantized (its temporaries recorded on the meta device), its run-dtype weight
freed, the cache emptied once at the end (quantize_events)."""

from __future__ import annotations

import contextlib
import functools
from typing import Any, List, Optional

from dsexp.quant import traits
from dsexp.quant.base import END, STREAM

EVENTS = "_dsexp_quantize_events"  # a rank model's recorded quantize phase (quant.empty_cache=end)

# fp8's config refuses a machine without a GPU of compute capability 8.9; on the meta device nothing runs, and the
# trace follows the path such a GPU takes (torch._scaled_mm, without the mslk package, as on the H100 here)
CAPABILITY_CHECKS = (
    "torch.cuda.is_available",
    "torchao.float8.inference.is_sm_at_least_89",
    "torchao.quantization.quant_api.is_sm_at_least_89",
)


def not_traced(s: Any) -> Optional[str]:
    """Why this strategy's quantized rank is not traced on the meta device; None where it is."""
    if s.kv_bits:
        return "the quantized KV cache (quanto's kernels) is not traced on the meta device"
    t = traits(s.quant) if s.quant else None
    if t is None:
        return None
    if t.library != "torchao":
        return f"quant={t.key} quantizes inside DeepSpeed's zero.Init and ZeRO-3 gathers each layer: not traced"
    if s.quant_order != STREAM:
        return f"quant.order={s.quant_order}: the blocks the engine loaded the run-dtype weights in are not modelled"
    return None


def quantize_on_meta(model, s: Any) -> None:
    """Quantize the meta model's linears in place as the member's rank code does (dsexp.quant.torchao_rank)."""
    from torchao.quantization import quantize_

    from dsexp.quant.torchao_rank import linear_filter, torchao_config

    config, keep = torchao_config(traits(s.quant), s.quant_group), linear_filter(model, s.quant_head)
    with as_on_gpu():
        if s.quant_empty_cache == END:
            setattr(model, EVENTS, quantize_events(model, config, keep))
        else:
            quantize_(model, config, filter_fn=keep)


@contextlib.contextmanager
def as_on_gpu():
    """torchao's device checks answered as the H100 would: fp8's compute capability 8.9 and int4's tinygemm packing
    (8.0 and up); the meta device has none."""
    from unittest import mock

    with contextlib.ExitStack() as stack:
        for target in CAPABILITY_CHECKS:
            stack.enter_context(mock.patch(target, lambda: True))
        stack.enter_context(mock.patch("torch.cuda.get_device_capability", lambda *a, **k: (9, 0)))
        yield


@functools.lru_cache(maxsize=256)
def quantize_temporaries(key: str, group: Optional[int], out_features: int, in_features: int) -> Optional[int]:
    """The most bytes torchao's quantize of one (out, in) linear in bf16 holds beside that weight (its temporaries
    and new tensors at their peak), traced on the meta device; None where the member is not torchao's. int4's
    tinygemm packing of InternLM2's output head (92,544 x 6,144) holds 5.3 GiB, five times its bf16 weight: at tp=2
    with the head quantized the H100's quantize phase peaked at 8.35 GiB, the other weights quantized, the head's
    shard in bf16 and half of that."""
    import torch
    from torchao.quantization import quantize_

    from dsexp.predict.meta_trace import live_peak, recorder
    from dsexp.quant.torchao_rank import torchao_config

    t = traits(key)
    if t is None or t.library != "torchao":
        return None
    linear = torch.nn.Linear(in_features, out_features, bias=False, dtype=torch.bfloat16, device="meta")
    record = recorder()()
    with as_on_gpu(), record:
        quantize_(linear, torchao_config(t, group))
    return live_peak(record.events)


def quantize_events(model, config, keep) -> List[Any]:
    """Quantize the meta model as one quantize_(model, config, filter_fn, device) does on a GPU, and return the
    allocator's events of that phase: torchao walks the modules depth first; a linear is moved (its weight and bias in
    the run dtype), quantized (its temporaries and new tensors, recorded), its run-dtype weight freed; any other
    module is moved after its children (its own tensors); then the cache is emptied once. On the H100, fp8 at tp=1:
    19.57 GiB allocated (here the same), 20.01 at the phase's peak (the same), 22.00 reserved at the peak (21.81),
    20.80 after the emptied cache (20.61)."""
    from torchao.quantization import quantize_

    from dsexp.predict.meta_trace import recorder

    events: List[Any] = []
    moved = set()
    counter = iter(range(1 << 62, 1 << 63))  # keys of the moved tensors: above the recorder's (storage addresses)

    def move(t) -> Optional[int]:
        storage = t.untyped_storage()
        if storage._cdata in moved:  # a tied tensor moves once
            return None
        moved.add(storage._cdata)
        key = next(counter)
        events.append(("alloc", key, storage.nbytes()))
        return key

    def walk(module, fqn: str) -> None:
        if keep(module, fqn):
            weight = move(module.weight)
            if module.bias is not None:
                move(module.bias)
            record = recorder()()
            with record:
                quantize_(module, config, filter_fn=lambda m, _fqn: m is module)
            events.extend(record.events)
            if weight is not None:
                events.append(("free", weight, 0))
            return
        for name, child in module.named_children():
            walk(child, f"{fqn}.{name}" if fqn else name)
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            move(t)

    walk(model, "")
    return events + [("release", None, 0)]


def allocation_order(model) -> List[Any]:
    """The quantize phase's events where it was recorded (quant.empty_cache=end: quantize_events); else bytes of each
    tensor a rank allocates on the GPU, in order, in stream order with the cache emptied after each
    linear (quantize_each): each quantized linear as the linears are walked (its bias, moved with it, then the
    quantized weight's inner tensors, each in blocks the emptied cache left to nothing else), then the rest as
    `module.to(device)` moves it (children first)."""
    from dsexp.core.tensors import is_wrapper
    from dsexp.predict.fragmentation import apply_order

    if getattr(model, EVENTS, None) is not None:
        return getattr(model, EVENTS)

    def inner(t) -> List[int]:
        if is_wrapper(t):
            names, _ = t.__tensor_flatten__()
            return [n for name in names if getattr(t, name, None) is not None for n in inner(getattr(t, name))]
        return [t.untyped_storage().nbytes()]

    out: List[int] = []
    seen = set()
    for parent in model.modules():
        for child in parent.children():
            own = list(child.parameters(recurse=False))
            if any(is_wrapper(t) for t in own) and id(child) not in seen:
                seen.update([id(child), *(id(t) for t in own)])
                out += [n for t in sorted(own, key=is_wrapper) for n in inner(t)]  # the bias, then the weight
    return out + apply_order(model, skip=seen)
