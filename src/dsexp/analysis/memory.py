"""Memory model: what each rank should hold, predicted from the model's config and the run's settings.

Weights: every parameter and buffer of the meta-built model (see architecture.py) is placed by the rule of the engine
that ran (`place` in dsexp.engines.<name>.placement), using the engine's own split functions where it has them, and
by the rules of the trims it ran (dsexp.trims.<key>.placement). DeepSpeed's init_inference casts every floating tensor
(buffers too) to the engine dtype; the other engines keep buffers in the dtype the model built them
(dsexp.analysis.placements.tensors).

On a GPU the caching allocator holds the weights in segments, not in their bytes: `reserve` replays the engine's
allocations through the allocator's rules (dsexp.analysis.allocator; exact to the byte for AutoTP on the H200),
for engines that say the order they allocate in (init_inference without kernel injection); for the others, the
weights' bytes.

KV cache: 2 x layers x kv_heads(rank) x head_dim x tokens x bytes. Device memory outside PyTorch's
allocator (CUDA context, NCCL communicator, cuBLAS workspaces, most created after `start`): measured by the
run itself, see `nonpytorch_overhead`. Host: what loading costs each rank, by loading strategy (`_host`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from dsexp.analysis import architecture as arch
from dsexp.analysis.allocator import Reserve, replay
from dsexp.analysis.placements import Placement, Strategy, Tensor, replicated, tensors, unchanged
from dsexp.analysis.user_script import as_pipeline_result, is_script
from dsexp.core.result import JobRecord, Phase
from dsexp.engines import ENGINES, part
from dsexp.engines.base import Placer
from dsexp.trims.dedupe_buffers import placement as dedupe


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
    reserve: List[int]  # what a GPU's caching allocator reserves to hold them (segments; dsexp.analysis.allocator;
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


def predict(result: Dict[str, Any], tp: Optional[int] = None) -> Prediction:
    """The memory model for this run's configuration, at its own tp or another one. A user's script is predicted
    from what its ranks did (the call it made, the model it loaded: dsexp.analysis.user_script), not from a preset."""
    if is_script(result):
        result = as_pipeline_result(result)
    strategy = Strategy.from_result(result)
    tp = int(tp or (result.get("config") or {}).get("tp") or 1)
    source = arch.model_source(result.get("config") or {}, result.get("runtime"))
    model = arch.meta_model(source, strategy.dtype)
    shared = dedupe.shared_buffers(source, strategy)
    placements, modules, notes, error, policy = place(model, strategy, tp, shared, with_policy=True)
    weights = [sum(p.local[r] for p in placements) for r in range(tp)]
    tokens = _tokens(result, strategy)
    d = arch.dims(model)
    kv = [_kv_bytes(d, _kv_heads(d.kv_heads, tp, r, strategy), tokens, strategy.dtype) for r in range(tp)]
    return Prediction(
        tp=tp,
        strategy=strategy,
        placements=placements,
        weights=weights,
        reserve=_reserve(placements, weights, strategy),
        kv_cache=kv,
        tokens=tokens,
        dims=d,
        overhead=nonpytorch_overhead(result),
        notes=notes,
        error=error,
        policy=policy,
        modules=modules,
        host=_host(result, strategy, tp, weights, placements),
    )


def place(model, strategy: Strategy, tp: int, shared: Optional[Dict[str, str]] = None, with_policy: bool = False):
    """(placements, predicted module changes, notes, error[, policy]) for any model (meta device) under a strategy.

    shared: with trim.dedupe_buffers, {buffer: the identical buffer it shares} (dsexp.trims.dedupe_buffers.placement);
    each shared one takes no bytes of its own on any rank.
    policy: how AutoTP's policy was found ({"policy", "source", "why", ...}); where DeepSpeed refuses for want of
    one, the policy `engine.injection_policy=infer` would use (so the diagnosis can name it)."""
    held = tensors(model, strategy)
    notes: List[str] = []
    found: Dict[str, Any] = {}
    try:
        placements, modules = placer(strategy.engine)(model, held, strategy, tp, notes, found)
        error = None
    except AssertionError as e:  # DeepSpeed's own refusal (e.g. AutoTP finds no policy)
        if not found:
            from dsexp.models.policy import infer_policy

            found.update(infer_policy(model), suggested=True)
        placements, modules = [replicated(t, tp) for t in held], unchanged()
        error = str(e) or "AssertionError"
    if shared:
        placements = dedupe.share(placements, shared, tp, notes)
    out = (placements, modules, notes, error)
    return (*out, found or None) if with_policy else out


def allocator_reserve(placements: List[Placement], rank: int, s: Strategy) -> Optional[Reserve]:
    """The caching allocator's reserve for this rank's weights, replaying the engine's allocations in its order (the
    engine member's `placement.allocation_order`); None where the engine does not say its order."""
    order = getattr(part(s.engine, "placement"), "allocation_order", None) if s.engine in ENGINES else None
    sizes = order(placements, rank, s) if order else None
    return replay(sizes) if sizes is not None else None


def _reserve(placements: List[Placement], weights: List[int], s: Strategy) -> List[int]:
    """Per rank: the allocator's reserve for the weights, or the weights themselves where it is not modelled."""
    held = [allocator_reserve(placements, r, s) for r in range(len(weights))]
    return [h.reserved if h is not None else w for h, w in zip(held, weights)]


def splits_weights(engine: str) -> bool:
    """Whether the engine gives each rank its own slice of the weights and of the KV heads (tensor parallelism)."""
    return engine in ENGINES and ENGINES[engine].splits_weights


# --- the engine's rule --------------------------------------------------------------------------------------


def placer(engine: str) -> Placer:
    """The engine member's placement rule; an engine dsexp does not know (a script's) keeps every tensor whole."""
    return part(engine, "placement").place if engine in ENGINES else _unknown_engine


def _unknown_engine(model, tensors: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    notes.append(f"no placement rule for engine {s.engine!r}: predicted as unsharded")
    return [replicated(t, tp) for t in tensors], unchanged()


# --- KV cache, context, host ---------------------------------------------------------------------


def _kv_heads(kv: int, tp: int, rank: int, s: Strategy) -> int:
    if not splits_weights(s.engine) or tp == 1:
        return kv
    return kv // tp + (1 if rank < kv % tp else 0)


def _kv_bytes(d: arch.Dims, kv_heads: int, tokens: int, dtype: str) -> int:
    return 2 * d.layers * kv_heads * d.head_dim * tokens * arch.DTYPE_BYTES[dtype]


def _tokens(result: Dict[str, Any], s: Strategy) -> int:
    """Prompt + generated tokens (kernel injection sizes its KV workspace for max_out_tokens instead)."""
    gen = (result.get("config") or {}).get("generate") or {}
    if s.kernel_inject and s.max_out_tokens:
        return s.max_out_tokens
    rank0 = next(iter(JobRecord.of(result).ranks), None)
    prompt = (rank0.raw.get("generate") or {}).get("prompt_ids") if rank0 else None
    n_prompt = len(prompt) if prompt else len(str(gen.get("prompt", "")).encode())
    return n_prompt + int(gen.get("new_tokens") or 0)


def nonpytorch_overhead(result: Dict[str, Any]) -> Optional[int]:
    """Device memory the floor adds to weights and KV cache, max over ranks: the process's memory outside
    PyTorch's allocator at its largest over the phases (NVML process used - torch reserved: CUDA context, NCCL
    communicator, cuBLAS workspaces, which mostly appear after `start`) plus what the device itself holds apart
    from the process at `start` (NVML device used - process used). Runs without per-process NVML figures fall
    back to the device memory in use after `start`."""
    from dsexp.analysis.measured import device_reserve

    vals = []
    for rk in JobRecord.of(result).ranks:
        start = rk.phase(Phase.START).gpu
        outside = [
            ph.gpu["nvml_process_used"] - (ph.gpu.get("gpu_reserved") or 0)
            for ph in rk.phases()
            if ph.gpu.get("nvml_process_used")
        ]
        reserve = device_reserve(result, rk)
        if outside and reserve is not None:
            vals.append(max(outside) + reserve)
        elif (start.get("nvml_device_used") or start.get("gpu_driver_used")) is not None:
            vals.append(start.get("nvml_device_used") or start.get("gpu_driver_used"))
    return max(vals) if vals else None


def _host(
    result: Dict[str, Any], s: Strategy, tp: int, weights: List[int], placements: List[Placement]
) -> HostPrediction:
    """Host bytes loading adds per rank at its peak (the interpreter's own imports during load, ~100-200 MiB,
    come on top). Eager loads mmap the checkpoint (.bin too: transformers >= 5 loads it with mmap=True) and
    touch the pages of what the rank takes: a whole tensor when it is replicated, partitioned by ZeRO or cut
    along columns, only its rows when cut along dim 0. A dtype conversion materialises a private converted
    copy; on a CPU run the TP slices a rank keeps are copies; offloaded ZeRO partitions live on the host."""
    model_run = sum(p.full for p in placements if not p.copy)
    files = _checkpoint_files(result, s, placements)
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
        biggest = [max((p.local[r] for p in placements if not (p.is_buffer or p.copy)), default=0) for r in range(tp)]
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
        sum(p.local[r] if p.dim == 0 else p.full for p in placements if not (p.is_buffer or p.copy)) for r in range(tp)
    ]
    return HostPrediction(
        touched,
        kept,
        kept,
        f"{s.fmt} is memory-mapped without conversion: the checkpoint sits in the page cache, "
        f"shared by the ranks; private memory ~ the slices each rank keeps",
    )


def _checkpoint_files(result: Dict[str, Any], s: Strategy, placements: List[Placement]) -> List[int]:
    """Bytes of each checkpoint file: the folder's, else as the writer packs the parameters (model dtype, shard_mb)."""
    files = arch.checkpoint_files((result.get("runtime") or {}).get("model_dir"))
    if files:
        return list(files.values())
    from dsexp.models.writer import plan_shards

    shard_mb = ((result.get("config") or {}).get("model") or {}).get("shard_mb")
    if not shard_mb:
        return []
    scale = arch.DTYPE_BYTES[s.model_dtype] / arch.DTYPE_BYTES[s.dtype]
    specs = [(p.name, (int(p.full * scale),)) for p in placements if not (p.is_buffer or p.copy)]
    return [sum(shape[0] for _, shape in shard) for shard in plan_shards(specs, 1, shard_mb)]


# --- ranks sharing a GPU ---------------------------------------------------------------------------

# What a rank's process holds on the device beyond its allocator before any collective: the CUDA context and the
# kernels loaded with it (NVML per process - torch reserved; 0.68 GiB on the H200 with torch 2.11 / CUDA 13, at 2, 4
# and 8 ranks sharing it alike). The fit check adds one per rank; the run itself measures it (start.outside.context).
CUDA_CONTEXT_BYTES = int(0.68 * 2**30)


def shared_gpu_fit(spec, total: int) -> Optional[Dict[str, Any]]:
    """Ranks sharing GPUs (spec.launcher.gpus): does the busiest GPU hold its ranks? Each rank's weights (as the
    allocator reserves them) and KV cache (the memory model) plus a CUDA context per rank, against the GPU's `total`
    bytes. None where the model cannot predict (the run will say)."""
    from dataclasses import asdict

    try:
        pred = predict({"config": asdict(spec), "runtime": {"device": "cuda"}})
    except Exception:
        return None
    per_node, gpus = spec.ranks_per_node, int(spec.launcher.gpus)
    busiest = [r for r in range(per_node) if r % gpus == 0]  # GPU 0 of the first node: local ranks 0, gpus, ...
    held = sum(pred.reserve[r] + pred.kv_cache[r] for r in busiest)
    need = held + len(busiest) * CUDA_CONTEXT_BYTES
    gib = 2**30
    return {
        "fits": need <= total,
        "need": need,
        "total": total,
        "ranks_on_gpu": len(busiest),
        "message": (
            f"tp={spec.tp} with launcher.gpus={gpus}: {len(busiest)} ranks share one GPU and are predicted to hold "
            f"{need / gib:.1f} GiB there ({held / gib:.1f} GiB of weights and KV cache from the memory model + "
            f"{len(busiest)} CUDA contexts of {CUDA_CONTEXT_BYTES / gib:.2f} GiB), more than the GPU's "
            f"{total / gib:.1f} GiB; use more GPUs (launcher.gpus), a larger tp's engine that splits the weights, "
            "or a smaller model"
        ),
    }
