"""Where the model's tensors live on this rank, counting only the local part of each.

Tensor-parallel shards (DeepSpeed's LinearLayer/LinearAllreduce) are plain tensors of the local
slice; transformers' TP uses DTensors (count `to_local()`); ZeRO-3 keeps an empty placeholder in
`param.data` and this rank's partition in `param.ds_tensor`.
"""
from __future__ import annotations

from collections import Counter
from typing import Any, Dict


def _local(t):
    if hasattr(t, "ds_tensor") and t.ds_tensor is not None:  # ZeRO-3 partition
        return t.ds_tensor
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) else t


def weight_census(module) -> Dict[str, Any]:
    """Bytes of parameters and buffers by device type, meta leftovers by name, module classes."""
    params: Counter = Counter()
    buffers: Counter = Counter()
    on_meta = []
    n_params = 0
    for name, p in module.named_parameters():
        t = _local(p)
        params[t.device.type] += t.numel() * t.element_size()
        n_params += t.numel()
        if t.device.type == "meta":
            on_meta.append(name)
    for name, b in module.named_buffers():
        buffers[b.device.type] += b.numel() * b.element_size()
        if b.device.type == "meta":
            on_meta.append(name)
    classes = Counter(type(m).__name__ for m in module.modules())
    return {"param_bytes": dict(params), "buffer_bytes": dict(buffers), "local_params": n_params,
            "on_meta": on_meta, "module_classes": dict(classes)}


def resident_bytes(census: Dict[str, Any], device_type: str) -> int:
    """Parameters + buffers resident on the rank's compute device (the host itself on the CPU accelerator)."""
    return census["param_bytes"].get(device_type, 0) + census["buffer_bytes"].get(device_type, 0)
