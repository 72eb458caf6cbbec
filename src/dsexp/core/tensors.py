"""Bytes a tensor really stores: a tensor subclass that wraps others (torchao's quantized weights, quanto's packed
tensors, a DTensor's local shard) is counted by the tensors it holds, not by its logical shape and dtype (a torchao
fp8 weight reports bf16 elements and stores one byte each, plus its scales)."""

from __future__ import annotations

from typing import Any


def stored_bytes_of(t: Any) -> int:
    """Bytes of one tensor as stored: a wrapper subclass's inner tensors (`__tensor_flatten__`), recursively."""
    if hasattr(t, "to_local"):  # a DTensor: its local shard
        return stored_bytes_of(t.to_local())
    if is_wrapper(t):
        names, _ = t.__tensor_flatten__()
        return sum(stored_bytes_of(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
    return t.numel() * t.element_size()


def is_wrapper(t: Any) -> bool:
    """A tensor subclass holding other tensors (torch's traceable wrapper subclass protocol)."""
    return getattr(type(t), "__tensor_flatten__", None) is not None and not hasattr(t, "to_local")


def stored_bytes(module: Any) -> int:
    """Parameters and buffers of a module as stored (each once)."""
    seen, total = set(), 0
    for t in (*module.parameters(), *module.buffers()):
        if id(t) not in seen:
            seen.add(id(t))
            total += stored_bytes_of(t)
    return total
