"""trim.dedupe_buffers on a rank: the duplicates held out of the model while the engine places it (`HeldBuffers`,
taken by dsexp.engines.rank.Engine.wrap), then put back sharing the placed tensors (`dedupe_buffers`, after the
engine and the loader's buffer restore)."""

from __future__ import annotations

from typing import Any, Dict, Optional

from dsexp.core.module_buffers import non_persistent_buffers, owner_of
from dsexp.trims.dedupe_buffers import duplicate_buffers
from dsexp.trims.rank import empty_cache, nbytes


def duplicates(model) -> Dict[str, str]:
    import torch

    return duplicate_buffers(model, torch.equal)


class HeldBuffers:
    """Duplicates taken out of their modules before the engine places the model (the device gets one copy each)."""

    def __init__(self, model):
        self.of = duplicates(model)  # held name -> the name of the buffer it will share
        self.held: Dict[str, Any] = {}
        for name in self.of:
            owner, leaf = owner_of(model, name)
            self.held[name] = owner._buffers.pop(leaf)
            owner._non_persistent_buffers_set.discard(leaf)

    def put_back(self, module) -> Dict[str, int]:
        """Register every held buffer again, as the placed tensor of the first of its group (or, if the engine
        replaced that one's owner, as its own copy on the device of the model's parameters)."""
        shared = own = gone = 0
        for name, first in self.of.items():
            owner, leaf = owner_of(module, name)
            if owner is None:
                gone += 1
                continue
            src_owner, src_leaf = owner_of(module, first)
            tensor = src_owner._buffers.get(src_leaf) if src_owner is not None else None
            if tensor is None or tensor.shape != self.held[name].shape:
                device = next((p.device for p in module.parameters() if not p.is_meta), self.held[name].device)
                tensor, own = self.held[name].to(device), own + 1
            else:
                shared += 1
            owner.register_buffer(leaf, tensor, persistent=False)
        self.held.clear()
        return {"held_before_engine": len(self.of), "put_back_shared": shared, "put_back_own": own, "owner_gone": gone}


def dedupe_buffers(module, held: Optional[HeldBuffers], device_type: str) -> Dict[str, Any]:
    """After the engine (and the loader's buffer restore): put held duplicates back, then point every remaining
    identical non-persistent buffer at the first of its group. Returns what it did, bytes on this rank."""
    report: Dict[str, Any] = held.put_back(module) if held is not None else {"held_before_engine": 0}
    before = {name: buf for name, _, _, buf in non_persistent_buffers(module)}
    found = {n: first for n, first in duplicates(module).items() if before[n] is not before[first]}
    for name, first in found.items():
        owner, leaf = owner_of(module, name)
        owner._buffers[leaf] = before[first]
    after = {id(b): b for _, _, _, b in non_persistent_buffers(module)}
    empty_cache(device_type)
    report.update(
        {
            "buffers": len(before),
            "distinct_after": len(after),
            "shared_after_engine": len(found),
            "bytes_before": sum(nbytes(b) for b in before.values()),  # each buffer its own copy: without the trim
            "bytes_after": sum(nbytes(b) for b in after.values()),
        }
    )
    return report
