"""zero_inference in the memory model: ZeRO-3 partitions every parameter 1/tp (each rank's flat partition is
ceil(numel / world) elements), buffers stay whole; with `offload=cpu` on a GPU the partitions live on the host. Also
autotp_zero3's rule outside AutoTP's layers (dsexp.engines.autotp_zero3.placement)."""

from __future__ import annotations

import math
from typing import Any, Dict, List, Optional

from dsexp.predict.placements import Placement, Strategy, Tensor, replicated, unchanged


def place(model, tensors: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Optional[Dict[str, Any]] = None):
    offloaded = s.offload == "cpu" and s.device == "cuda"
    if s.offload == "cpu" and s.device != "cuda":
        notes.append("offload=cpu on a CPU run: the host is the device, the partitions stay where they are counted")
    out = []
    for t in tensors:
        if t.is_buffer:
            out.append(replicated(t, tp))
            continue
        part = math.ceil(t.numel / tp) * t.itemsize
        out.append(
            Placement(
                t.name, t.numel * t.itemsize, (0 if offloaded else part,) * tp, "offloaded" if offloaded else "zero3"
            )
        )
    return out, unchanged()
