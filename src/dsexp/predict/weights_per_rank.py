"""The weights per rank and what loading them costs the host: the sum of each rank's placements, the caching
allocator's reserve for them (dsexp.predict.allocator), and the host bytes of each loading strategy.

Every parameter and buffer of the meta-built model (dsexp.predict.architecture) is placed by the rule of the engine
that ran and the trims it ran (a dsexp.predict.placements.Placer, handed in by the families' dispatch,
dsexp.engines.placement). DeepSpeed's init_inference casts every floating tensor (buffers too) to the engine dtype;
the other engines keep buffers in the dtype the model built them (dsexp.predict.placements.tensors).

On a GPU the caching allocator holds the weights in segments, not in their bytes: `reserve` replays the engine's
allocations through the allocator's rules (exact to the byte for AutoTP on the H200), for engines that say the order
they allocate in (init_inference without kernel injection); for the others, the weights' bytes.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from dsexp.predict import architecture as arch
from dsexp.predict.allocator import replay
from dsexp.predict.placements import Placement, Strategy

# An engine's allocation order: the bytes of each tensor a rank allocates on the GPU, in order; None: not modelled.
AllocationOrder = Callable[[List[Placement], int, Strategy], Optional[List[int]]]


@dataclass
class HostPrediction:
    """Host bytes each rank adds while loading, on top of its `start` snapshot."""

    file: List[int]  # file-backed (mmap'd checkpoint pages mapped at the load peak: page cache, shared)
    anon: List[int]  # private memory at the load peak (conversions, kept slices, offloaded partitions)
    kept: List[int]  # private bytes a rank keeps whatever the loading (TP slices on a CPU run, offload)
    how: str  # one sentence: why

    @property
    def node(self) -> int:
        """Node-wide growth: private bytes add up over ranks; mapped page cache counts as available."""
        return sum(self.anon)


@dataclass
class Prediction:
    tp: int
    strategy: Strategy
    placements: List[Placement]
    weights: List[int]  # bytes on each rank's compute device
    reserve: List[int]  # what a GPU's caching allocator reserves to hold them (segments; dsexp.predict.allocator;
    # the weights themselves where the engine does not say the order it allocates them in)
    kv_cache: List[int]
    tokens: int
    dims: arch.Dims
    overhead: Optional[int]  # device memory outside PyTorch's allocator, measured (GPU runs only)
    host: HostPrediction
    modules: Dict[str, Dict[str, int]]
    notes: List[str] = field(default_factory=list)
    error: Optional[str] = None  # the engine cannot run this (e.g. AutoTP finds no policy)
    policy: Optional[Dict[str, Any]] = None  # how the AutoTP policy was found (dsexp.models.policy.infer_policy)

    @property
    def model_bytes(self) -> int:
        return sum(p.full for p in self.placements if not p.copy)

    @property
    def weights_max(self) -> int:
        return max(self.weights)

    @property
    def fraction(self) -> float:
        return self.weights_max / self.model_bytes if self.model_bytes else float("nan")

    @property
    def sharded(self) -> bool:
        return any(p.how != "replicated" for p in self.placements) and self.tp > 1

    @property
    def unshardable(self) -> int:
        """Bytes every rank holds whole whatever the tp (the floor any tp leaves on a device)."""
        return sum(p.full for p in self.placements if p.how == "replicated" and not p.copy)

    def replicated(self) -> Dict[str, int]:
        """Bytes every rank holds in full, grouped by name pattern (layer numbers as *)."""
        groups: Counter = Counter()
        for p in self.placements:
            if p.how == "replicated":
                groups[re.sub(r"\.\d+\.", ".*.", p.name)] += p.full
        return dict(groups.most_common())

    @property
    def segment_slack(self) -> int:
        """The largest rank's reserve beyond its weights: segments the allocator took and the weights do not fill."""
        return max(r - w for r, w in zip(self.reserve, self.weights))

    def floor(self) -> int:
        """Per-GPU floor, max over ranks: the allocator's reserve for the weights + KV cache + the memory outside
        PyTorch's allocator."""
        per_rank = max(r + k for r, k in zip(self.reserve, self.kv_cache))
        return per_rank + (self.overhead or 0)


def per_rank(placements: List[Placement], tp: int) -> List[int]:
    """Bytes of weights on each rank's compute device."""
    return [sum(p.local[r] for p in placements) for r in range(tp)]


def reserve(
    placements: List[Placement], weights: List[int], s: Strategy, order: Optional[AllocationOrder]
) -> List[int]:
    """Per rank: the allocator's reserve for the weights (the engine's allocations replayed in its order), or the
    weights themselves where the engine does not say its order."""
    held = [order(placements, r, s) if order else None for r in range(len(weights))]
    return [
        replay(sizes, s.expandable_segments).reserved if sizes is not None else w for sizes, w in zip(held, weights)
    ]


def host(files: List[int], s: Strategy, tp: int, weights: List[int], placements: List[Placement]) -> HostPrediction:
    """Host bytes loading adds per rank at its peak (the interpreter's own imports during load, ~100-200 MiB,
    come on top), from the checkpoint's file sizes (`files`: checkpoint_sizes). Eager loads mmap the checkpoint
    (.bin too: transformers >= 5 loads it with mmap=True) and touch the pages of what the rank takes: a whole tensor
    when it is replicated, partitioned by ZeRO or cut along columns, only its rows when cut along dim 0. A dtype
    conversion materialises a private converted copy; on a CPU run the TP slices a rank keeps are copies; offloaded
    ZeRO partitions live on the host."""
    model_run = sum(p.run_full or p.full for p in placements if not p.copy)  # a quantized weight as loaded
    ckpt = sum(files) or model_run * arch.DTYPE_BYTES[s.model_dtype] // arch.DTYPE_BYTES[s.dtype]
    on_host = s.device == "cpu"  # on a CPU run the device *is* the host
    offload = sum(math.ceil(p.full / tp) for p in placements if p.how == "offloaded")
    kept = [
        (sum(p.local[r] for p in placements if p.how not in ("replicated", "offloaded")) if on_host else 0) + offload
        for r in range(tp)
    ]
    if s.load == "meta":
        largest = max(files, default=ckpt)
        return HostPrediction(
            [largest] * tp,
            [largest + k for k in kept],
            kept,
            "every rank reads every checkpoint file in full, one file at a time",
        )
    if s.load == "sharded":
        biggest = [
            max(((p.run_local or p.local)[r] for p in placements if not (p.is_buffer or p.copy)), default=0)
            for r in range(tp)
        ]
        return HostPrediction(
            biggest,
            [(w if on_host else 0) + offload for w in weights],
            kept,
            "each rank reads only its own slice and the replicated tensors, one tensor at a time "
            "(the largest one mapped at once)",
        )
    if s.conversion:
        return HostPrediction(
            [ckpt] * tp,
            [model_run + offload] * tp,
            kept,
            f"the load converts ({s.conversion}): a private full copy per rank",
        )
    touched = [
        sum(
            (p.run_local or p.local)[r] if p.dim == 0 else p.run_full or p.full
            for p in placements
            if not (p.is_buffer or p.copy)
        )
        for r in range(tp)
    ]
    return HostPrediction(
        touched,
        kept,
        kept,
        f"{s.fmt} is memory-mapped without conversion: the checkpoint sits in the page cache, "
        f"shared by the ranks; private memory ~ the slices each rank keeps",
    )


def checkpoint_sizes(
    folder: Optional[str], shard_mb: Optional[float], s: Strategy, placements: List[Placement]
) -> List[int]:
    """Bytes of each checkpoint file (`files`, for `host`): the folder's, else as the writer packs the parameters
    (model dtype, shard_mb); none where neither says."""
    files = arch.checkpoint_files(folder)
    if files:
        return list(files.values())
    from dsexp.models.writer import plan_shards

    if not shard_mb:
        return []
    scale = arch.DTYPE_BYTES[s.model_dtype] / arch.DTYPE_BYTES[s.dtype]
    # a quantized weight is in the checkpoint at the run dtype's width (run_full), not at the member's
    specs = [(p.name, (int((p.run_full or p.full) * scale),)) for p in placements if not (p.is_buffer or p.copy)]
    return [sum(shape[0] for _, shape in shard) for shard in plan_shards(specs, 1, shard_mb)]
