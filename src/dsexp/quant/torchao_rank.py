"""The torchao members on a rank: `torchao.quantization.quantize_` over the model's linear layers (the decoder's
nn.Linear, and AutoTP's LinearLayer/LinearAllreduce where the engine sharded them), after the engine placed the
model: torchao's tensors cannot be split by AutoTP (aten.split_with_sizes), so AutoTP shards first and its linears are
quantized after. The embeddings stay in the run dtype, and the output head too (as transformers' TorchAoConfig leaves
them) unless quant.head=true. Order `stream`: the engine left the model on the host and each linear is moved to the
device and quantized there, one at a time (quantize_'s `device`), so the device never holds the model in the run
dtype; `after`: the model is quantized where the engine placed it. Imported on ranks only."""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, Optional

from dsexp.core.tensors import stored_bytes
from dsexp.quant.autotp_linear import AUTOTP_LINEARS
from dsexp.quant.base import EACH, STREAM, QuantTraits


def torchao_config(t: QuantTraits, group: Optional[int]):
    """The member's torchao config instance."""
    from torchao.quantization import (
        Float8DynamicActivationFloat8WeightConfig,
        Float8WeightOnlyConfig,
        Int4WeightOnlyConfig,
        Int8WeightOnlyConfig,
        PerRow,
    )

    if t.key == "fp8":
        return Float8DynamicActivationFloat8WeightConfig(granularity=PerRow())
    if t.key == "fp8_weight":
        return Float8WeightOnlyConfig()
    if t.key == "int8_weight":
        return Int8WeightOnlyConfig()
    if t.key == "int4_weight":
        return Int4WeightOnlyConfig(group_size=group or t.storage.group, int4_packing_format="tile_packed_to_4d")
    raise KeyError(f"quant={t.key}: no torchao config")


def linear_filter(model, with_head: bool = False) -> Callable[[Any, str], bool]:
    """quantize_'s filter: the model's linear layers (nn.Linear, AutoTP's), the output head only `with_head`."""
    import torch.nn as nn

    head = None if with_head else output_head(model)

    def is_linear(module, fqn: str) -> bool:
        if module is head or getattr(module, "weight", None) is None:
            return False
        return isinstance(module, nn.Linear) or type(module).__name__ in AUTOTP_LINEARS

    return is_linear


def output_head(model):
    """The model's output head (None where it names none)."""
    return model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None


def quantize(
    module,
    t: QuantTraits,
    group: Optional[int],
    order: str,
    device: str,
    empty: str = EACH,
    head: bool = False,
    head_first: bool = False,
) -> Dict[str, Any]:
    """Quantize the module's linears in place (the output head too with `head`); what was done: the call, the order,
    the linears quantized, the weights' bytes before and after (stored: scales and zero-points included) and the
    seconds it took. On a GPU with `empty` each, one linear at a time with the allocator's cache emptied after each
    (quantize_each; the head first with `head_first`). AutoTP's linears whose new weight lacks a transpose get their
    product as F.linear."""
    import torch
    from torchao.quantization import quantize_

    from dsexp.quant.autotp_linear import adapt

    keep = linear_filter(module, head)
    names = [n for n, m in module.named_modules() if keep(m, n)]
    before = stored_bytes(module)
    to = device if order == STREAM and device != "cpu" else None
    on_gpu = device.startswith("cuda")
    start = time.perf_counter()
    first = output_head(module) if head and head_first and on_gpu and empty == EACH else None
    if on_gpu and empty == EACH:
        quantize_each(module, torchao_config(t, group), keep, to, first)
    else:
        quantize_(module, torchao_config(t, group), filter_fn=keep, device=to)
        if on_gpu:
            torch.cuda.empty_cache()
    if to is not None:
        module.to(device)  # what stays in the run dtype: embeddings, norms, the head, buffers
    adapted = adapt(module) if t.autotp_linear else []
    if on_gpu:
        torch.cuda.synchronize()
    return {
        "member": t.key,
        "library": "torchao",
        "call": t.call,
        "order": order,
        "empty_cache": empty if on_gpu else None,
        "linears": len(names),
        "first": names[:3],
        "head": head,
        "head_first": first is not None,
        "autotp_as_linear": len(adapted),
        "bytes_before": before,
        "bytes_after": stored_bytes(module),
        "seconds": time.perf_counter() - start,
    }


def quantize_each(
    module, config, keep: Callable[[Any, str], bool], device: Optional[str], first: Optional[Any] = None
) -> None:
    """quantize_ one linear at a time, the allocator's cache emptied after each. Quantizing a linear frees its
    run-dtype weight while the quantized one lives on; a later, smaller request (the next quantized weight) split
    from that freed block leaves the rest cached inside a segment empty_cache can no longer release: on the H100 fp8
    held 1264 MiB more reserved than allocated after a quantize_ of the whole model (results/h200/quant). Emptying
    the cache while nothing else is free puts each quantized weight in segments of its own. quantize_ is called on
    the linear itself: over a parent it moves every module it walks to `device`, and over the root (the output head's
    parent) that was the whole bf16 rank: 21.15 GiB allocated at the phase's peak for 5.30 GiB of int4 weights
    (quant.head=true, tp=2, the H100). `first` (the output head, quant.head_first) is quantized before the others,
    while the device holds least: tinygemm's int4 packing holds five times the head's bf16 bytes beside it."""
    import torch
    from torchao.quantization import quantize_

    children = list(module.named_modules())
    children.sort(key=lambda item: item[1] is not first)  # stable: the model's order after `first`
    for name, child in children:
        if keep(child, name):
            quantize_(child, config, filter_fn=lambda m, _fqn, c=child: m is c, device=device)  # in place
            torch.cuda.empty_cache()
