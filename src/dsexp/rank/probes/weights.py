"""Where the model's tensors live on this rank, counting only the local part of each.

Tensor-parallel shards (DeepSpeed's LinearLayer/LinearAllreduce) are plain tensors of the local
slice; transformers' TP uses DTensors (count `to_local()`); ZeRO-3 keeps an empty placeholder in
`param.data` and this rank's partition in `param.ds_tensor`.
"""

from __future__ import annotations

import math
from collections import Counter
from typing import Any, Dict, Tuple

from dsexp.core.tensors import is_wrapper, stored_bytes_of


def _local(t):
    if hasattr(t, "ds_tensor") and t.ds_tensor is not None:  # ZeRO-3 partition
        # Persistent (small) parameters stay whole on every rank once first gathered.
        return t.data if getattr(t, "ds_persist", False) and t.data.numel() == t.ds_numel else t.ds_tensor
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def _full_shape(t) -> Tuple[int, ...]:
    """The tensor's shape in the whole model (ZeRO-3 keeps it in ds_shape; a DTensor's shape is global)."""
    return tuple(getattr(t, "ds_shape", None) or t.shape)


def tensor_layout(module) -> Dict[str, Dict[str, Tuple[int, ...]]]:
    """Full shapes of the model's parameters and buffers by qualified name (taken before an engine shards it)."""
    return {
        "params": {n: _full_shape(p) for n, p in module.named_parameters()},
        "buffers": {n: _full_shape(b) for n, b in module.named_buffers()},
    }


def residency(full: Dict[str, Dict[str, Tuple[int, ...]]], module, device_type: str, itemsize: int) -> Dict[str, Any]:
    """What this rank holds after the engine, against the full model recorded by `tensor_layout`.

    weight_fraction: parameter bytes resident on the rank's device / the full model's parameter bytes at
    the run dtype (`itemsize`); 1/tp for perfect tensor parallelism, 1.0 when nothing was sharded.
    replicated: {name: bytes} of parameters and buffers held whole on the device (local shape == full
    shape), found by comparing shapes; parameters the engine renamed or introduced are not listed.
    """
    full_params = sum(math.prod(s) for s in full["params"].values()) * itemsize
    local_params, replicated = 0, {}
    for kind, named in (("params", module.named_parameters()), ("buffers", module.named_buffers())):
        for name, t in named:
            loc = _local(t)
            if loc.device.type != device_type:
                continue
            nbytes = stored_bytes_of(loc)
            if kind == "params":
                local_params += nbytes
            if full[kind].get(name) == tuple(loc.shape):
                replicated[name] = nbytes
    return {
        "weight_fraction": local_params / full_params if full_params else None,
        "weight_bytes_local": local_params,
        "weight_bytes_full": full_params,
        "replicated": replicated,
        "replicated_bytes": sum(replicated.values()),
    }


def tensor_bytes(module, device_type: str) -> Dict[str, int]:
    """{tensor name: local bytes on this rank's device} for every parameter and buffer, each storage counted once.

    The local part is what this rank holds: its ZeRO-3 partition, its DTensor shard, the plain tensor otherwise.
    A storage two names share (a tied weight: transformers TP lists it under both names) is counted under the first
    name only; tensors on another device (offloaded, meta) are left out. Compact: names and integers only."""
    out: Dict[str, int] = {}
    seen = set()
    named = [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False),
    ]
    for name, t in named:
        if t is None:
            continue
        loc = _local(t)
        if loc.device.type != device_type:
            continue
        nbytes = stored_bytes_of(loc)
        plain = nbytes and not is_wrapper(loc)  # a quantized weight has no storage of its own: its inner tensors do
        key = (loc.untyped_storage().data_ptr(), loc.storage_offset(), tuple(loc.shape)) if plain else ("id", id(t))
        if key in seen:
            continue
        seen.add(key)
        out[name] = nbytes
    return out


def weight_census(module) -> Dict[str, Any]:
    """Bytes of parameters and buffers by device type, meta leftovers by name, module classes."""
    params: Counter = Counter()
    buffers: Counter = Counter()
    on_meta = []
    n_params = 0
    for name, p in module.named_parameters():
        t = _local(p)
        params[t.device.type] += stored_bytes_of(t)
        n_params += t.numel()
        if t.device.type == "meta":
            on_meta.append(name)
    for name, b in module.named_buffers():
        buffers[b.device.type] += stored_bytes_of(b)
        if b.device.type == "meta":
            on_meta.append(name)
    classes = Counter(type(m).__name__ for m in module.modules())
    return {
        "param_bytes": dict(params),
        "buffer_bytes": dict(buffers),
        "local_params": n_params,
        "on_meta": on_meta,
        "module_classes": dict(classes),
    }


def resident_bytes(census: Dict[str, Any], device_type: str) -> int:
    """Parameters + buffers resident on the rank's compute device (the host itself on the CPU accelerator)."""
    return census["param_bytes"].get(device_type, 0) + census["buffer_bytes"].get(device_type, 0)
