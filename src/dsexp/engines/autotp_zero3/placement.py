"""autotp_zero3 in the memory model: the model is loaded under zero.Init over all ranks and the weights a rank keeps
are its ZeRO-3 partitions (parameters 1/tp, buffers whole), as for zero_inference; with a policy, dsexp passes it as a
partition_config, and AutoTP gathers each Linear of the policy layers and keeps its shard (plain LinearLayer /
LinearAllreduce: no fused-qkv or gate-up layouts, no lm_head), which ZeRO-3 then partitions over the data-parallel
group of world / tp = 1 rank. AutoTP replaces the layers' Linears (the module changes are AutoTP's)."""

from __future__ import annotations

from collections import Counter
from typing import Any, Dict, List, Tuple

from dsexp.engines.init_inference.placement import autotp, autotp_meta, autotp_place, autotp_rules
from dsexp.engines.zero_inference.placement import place as zero3
from dsexp.predict.placements import Strategy, Tensor


def place(model, tensors: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    zero, _ = zero3(model, tensors, s, tp, notes)
    if not s.policy:  # DeepSpeed's own choice (the model's tp_plan or its parser): modelled as ZeRO-3 alone
        notes.append(
            "autotp_zero3 without a policy modelled as ZeRO-3 partitioning over all ranks (parameters 1/tp, "
            "buffers whole); the module replacements are AutoTP's"
        )
        _, modules = autotp(model, tensors, s, tp, [], found)
        return zero, modules
    rules = autotp_rules(model, s, tp, notes, found)
    meta = autotp_meta(model)
    by_module = _policy_linears(model, rules)
    out = [
        autotp_place(t, *by_module[t.module], None, tp, meta) if t.module in by_module and not t.is_buffer else z
        for t, z in zip(tensors, zero)
    ]
    notes.append(
        "autotp_zero3 with a policy: the policy layers' Linears hold their AutoTP shards (row-parallel biases whole), "
        "every other parameter its ZeRO-3 partition (1/tp), buffers whole"
    )
    replaced = Counter(cls for _, cls in by_module.values())
    return out, {"removed": {"Linear": sum(replaced.values())} if replaced else {}, "added": dict(replaced)}


def _policy_linears(model, rules: Dict[str, tuple]) -> Dict[str, Tuple[str, str]]:
    """module name -> (its name in the layer, LinearAllreduce for the policy's row-parallel ones, else LinearLayer)."""
    import torch.nn as nn

    from dsexp.models.policy import ds_name as policy_name

    by_module: Dict[str, Tuple[str, str]] = {}
    for lname, layer in model.named_modules():
        rows = rules.get(type(layer).__name__)
        if rows is None:
            continue
        for rel, child in layer.named_modules():
            if rel and isinstance(child, nn.Linear):
                row = rel in rows or policy_name(rel) in rows
                by_module[f"{lname}.{rel}"] = (rel, "LinearAllreduce" if row else "LinearLayer")
    return by_module
