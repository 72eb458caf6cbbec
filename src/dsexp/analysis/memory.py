"""Memory model: what each rank should hold, predicted from the model's config and the run's settings.

Weights: every parameter and buffer of the meta-built model (see architecture.py) is placed by the
rule of the engine that ran, using the engine's own split functions where it has them:
- `init_inference` without kernel injection (AutoTP, also with a user injection policy, or the one
  `engine.injection_policy=infer` finds, dsexp.models.policy): inside each policy layer every nn.Linear is
  split, column-parallel (LinearLayer, out dim) or row-parallel (LinearAllreduce, in dim, bias replicated),
  with DeepSpeed's `get_shard_size_list` (KV-head units for attention, 64-grain near-even splits for MLP);
  fused qkv (`qkv_proj`, `query_key_value`, `c_attn`, ...) is cut by DeepSpeed's own `prepare_tp_fused_qkvw`
  for the layer's fused layout (bloomtype rows, phi3type q/k/v each, bigcodetype q split + kv whole, ...),
  a fused `gate_up_proj` as two halves (GateUpPack_LinearLayer), an nn.Embedding inside a layer on its
  hidden dim; MoE routers (`mlp.gate`, qwen2_moe's `shared_expert_gate`) stay whole, and so do MoE experts
  stored as 3-D parameters (no Linear for AutoTP to replace); a top-level `lm_head`/`embed_out` becomes
  LmHeadLinearAllreduce (split on the hidden dim), which clones a tied weight first: the embedding stays
  whole and the head is a new [V, H/tp] tensor (a `copy` placement, not part of the model's bytes);
  everything else (embeddings, a head named otherwise, norms, rotary buffers) stays replicated.
  tp=1 without a policy shards nothing.
- `init_inference` with kernel injection: layers whose class has a DeepSpeed policy have their matrices
  split 1/tp; without a matching policy (e.g. InternLM2) nothing is sharded.
- `zero_inference` (ZeRO-3): every parameter partitioned 1/tp (padded), buffers replicated; with
  `offload=cpu` the partitions live on the host.
- `autotp_zero3`: the model is loaded under zero.Init over all ranks and the weights a rank keeps are its
  ZeRO-3 partitions (parameters 1/tp, buffers whole), as for `zero_inference`; AutoTP replaces the layers'
  Linears (the module changes are AutoTP's).
- `hf_tp`: the model's own transformers TP plan (DTensor shards, torch.chunk sizes): colwise/packed_colwise
  cut the output dim (dim 0 of a Linear weight, dim 1 of a 3-D expert parameter), rowwise the last dim
  (biases replicated), embeddings dim 0 (rowwise) or 1 (colwise); a tied embedding/head is one tensor.
DeepSpeed's init_inference casts every floating tensor (buffers too) to the engine dtype; the other
engines keep buffers in the dtype the model built them.

KV cache: 2 x layers x kv_heads(rank) x head_dim x tokens x bytes. Device memory outside PyTorch's
allocator (CUDA context, NCCL communicator, cuBLAS workspaces, most created after `start`): measured by the
run itself, see `nonpytorch_overhead`. Host: what loading costs each rank, by loading strategy (`_host`).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from dsexp.analysis import architecture as arch
from dsexp.analysis.placements import (
    Placement,
    Strategy,
    Tensor,
    chunks,
    even,
    itemsize,
    replicated,
    split,
    tensors,
    unchanged,
)
from dsexp.analysis.scripts import as_pipeline_result, is_script
from dsexp.core.engines import ENGINES, INFER, traits
from dsexp.models.kernel_policy import kernel_policy_classes, tp_plan
from dsexp.trims.dedupe_buffers import placement as dedupe
from dsexp.trims.shard_embedding.placement import embedding_to_split
from dsexp.trims.shard_head import HEAD_NAMES
from dsexp.trims.shard_head.placement import aliased_head


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

    def floor(self) -> int:
        """Per-device floor: weights + KV cache (+ the memory outside PyTorch on GPUs), max over ranks."""
        per_rank = max(w + k for w, k in zip(self.weights, self.kv_cache))
        return per_rank + (self.overhead or 0)


def predict(result: Dict[str, Any], tp: Optional[int] = None) -> Prediction:
    """The memory model for this run's configuration, at its own tp or another one. A user's script is predicted
    from what its ranks did (the call it made, the model it loaded: dsexp.analysis.scripts), not from a preset."""
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
        placer = PLACERS.get(strategy.engine, _unknown_engine)
        placements, modules = placer(model, held, strategy, tp, notes, found)
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


def splits_weights(engine: str) -> bool:
    """Whether the engine gives each rank its own slice of the weights and of the KV heads (tensor parallelism)."""
    return engine in ENGINES and traits(engine).splits_weights


# --- engines -------------------------------------------------------------------------------------

Placer = Callable[
    [Any, List[Tensor], Strategy, int, List[str], Dict[str, Any]], Tuple[List[Placement], Dict[str, Dict[str, int]]]
]


def _init_inference(model, tensors, s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    if s.kernel_inject:
        return _kernel_inject(model, tensors, tp, notes)
    return _autotp(model, tensors, s, tp, notes, found)


def autotp_rules(model, s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]) -> Optional[Dict[str, tuple]]:
    """{layer class: row-parallel names} AutoTP applies, or None when it does not run (tp=1 without a policy).
    Raises AssertionError where DeepSpeed refuses (no policy found). `found` gets how the policy was found."""
    from deepspeed.module_inject.auto_tp import AutoTP

    if s.policy == INFER:
        from dsexp.models.policy import infer_policy

        found.update(infer_policy(model))
        if not found.get("policy"):
            raise AssertionError(f"engine.injection_policy=infer found no policy: {found.get('why')}")
        notes.append(f"AutoTP policy ({found['source']}): {found['why']}")
        return {cls: tuple(names) for cls, names in found["policy"].items()}
    if s.policy:
        return {cls: tuple(names) for cls, names in s.policy.items()}
    if tp > 1:
        return {cls.__name__: tuple(names) for cls, names in AutoTP.tp_parser(model)}
    notes.append("tp=1 without an injection policy: AutoTP does not run, every tensor stays whole")
    return None


def _autotp(model, tensors, s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    """DeepSpeed AutoTP as `replace_wo_policy` + `set_lm_head` apply it (deepspeed/module_inject)."""
    import torch.nn as nn
    from deepspeed.inference.config import DeepSpeedTPConfig
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    from dsexp.models.policy import ds_name as policy_name

    rules = autotp_rules(model, s, tp, notes, found)
    if rules is None:
        return [replicated(t, tp) for t in tensors], unchanged()
    meta = AutoTPMeta.from_model_config(model.config, DeepSpeedTPConfig().tp_grain_size)
    # module name -> (DeepSpeed's name for it, replacement class, the decoder layer it sits in)
    by_module: Dict[str, Tuple[str, str, Any]] = {}
    for lname, layer in model.named_modules():
        if type(layer).__name__ not in rules:
            continue
        for rel, child in layer.named_modules():
            if not rel:
                continue
            name = policy_name(rel)  # parent attr + '.' + attr, as AutoTP names it
            if isinstance(child, nn.Linear):
                cls = _autotp_class(name, rules[type(layer).__name__], tp, layer)
            elif isinstance(child, nn.Embedding):
                cls = "Embedding"  # AutoTP's _slice_embedding: hidden dim split
            else:
                continue
            by_module[f"{lname}.{rel}"] = (name, cls, layer)
    head = next((n for n in HEAD_NAMES if isinstance(getattr(model, n, None), nn.Linear)), None)
    if head and s.deepspeed_before(0, 15) and s.load != "meta":
        # DeepSpeed 0.14 calls set_lm_head only when init_inference loads a checkpoint (replace_module.py)
        notes.append(
            f"DeepSpeed {s.deepspeed} splits the head ({head}) only with checkpoint= (load=meta): it stays whole"
        )
        head = None
    head = head or aliased_head(model, s, tp)  # aliased as lm_head while init_inference runs (trim.shard_head)
    if head:
        by_module[head] = ("lm_head", "LmHeadLinearAllreduce", None)
    embedding = embedding_to_split(model, s, tp)
    if embedding:
        by_module[embedding] = (embedding, "VocabParallelEmbedding", None)  # named as the rank names it: its module
    out = []
    for t in tensors:
        name, cls, layer = by_module.get(t.module, (None, None, None))
        out.append(_autotp_place(t, name, cls, layer, tp, meta))
    if head and not any(t.module == head and t.name.endswith(".weight") for t in tensors):
        # tied to the embedding: LmHeadLinearAllreduce clones the weight, then keeps its [V, H/tp] slice
        w = getattr(model, head).weight
        clone = Tensor(f"{head}.weight", head, w.numel(), tuple(w.shape), itemsize(w, s), False)
        copy = _autotp_place(clone, "lm_head", "LmHeadLinearAllreduce", None, tp, meta)
        copy.copy, copy.how = True, "LmHeadLinearAllreduce (clone of the tied embedding)"
        out.append(copy)
        notes.append(
            f"the head is tied to the embedding: AutoTP clones it ({head}.weight split on the hidden dim, "
            "a new tensor) and the embedding stays whole"
        )
    replaced = Counter(cls for _, cls, _ in by_module.values() if cls not in ("skip", "Embedding"))
    removed = Counter({"Linear": sum(n for cls, n in replaced.items() if cls != "VocabParallelEmbedding")})
    removed["Embedding"] = replaced.get("VocabParallelEmbedding", 0)
    return out, {"removed": {k: n for k, n in removed.items() if n}, "added": dict(replaced)}


def _autotp_place(t: Tensor, name: Optional[str], cls: Optional[str], layer, tp: int, meta) -> Placement:
    """One tensor under AutoTP's replacement `cls` (None: left alone)."""
    from deepspeed.module_inject.tp_shard import get_shard_size_list

    if cls is None or cls == "skip" or t.is_buffer:
        return replicated(t, tp)
    if cls in ("LinearAllreduce", "LmHeadLinearAllreduce"):
        if len(t.shape) != 2:  # row-parallel bias stays whole
            return replicated(t, tp)
        return split(t, 1, get_shard_size_list(t.shape[1], tp, meta, name), cls)
    if cls == "Embedding":
        return split(t, 1, get_shard_size_list(t.shape[1], tp, meta, name), cls)
    if cls == "GateUpPack_LinearLayer":  # gate and up halves, each split as an MLP width
        half = t.shape[0] // 2
        widths = get_shard_size_list(half, tp, meta, "mlp")
        return split(t, 0, [2 * w for w in widths], cls)
    if cls == "fused_LinearLayer":
        return _fused_qkv(t, layer, tp, meta)
    return split(t, 0, get_shard_size_list(t.shape[0], tp, meta, name), cls)


def _fused_qkv(t: Tensor, layer, tp: int, meta) -> Placement:
    """A fused qkv weight (or bias) cut by DeepSpeed's own prepare_tp_fused_qkvw for this layer's fused layout
    (run on a meta tensor of its shape: only the shapes are computed)."""
    import torch
    from deepspeed.module_inject.fusedqkv_utils import get_fused_qkv_type, prepare_tp_fused_qkvw

    kind = get_fused_qkv_type(layer) or "bloomtype (DeepSpeed's fallback)"
    src = torch.empty(t.shape, device="meta")
    try:
        rows = [int(prepare_tp_fused_qkvw(layer, src, tp, r, meta).shape[0]) for r in range(tp)]
    except Exception:  # a layout DeepSpeed's helper cannot cut this tensor with (e.g. a bias for phi3type)
        rows = even(t.shape[0], tp)
    other = t.numel // t.shape[0]
    local = tuple(r * other * t.itemsize for r in rows)
    return Placement(t.name, t.numel * t.itemsize, local, f"fused_LinearLayer ({kind})", dim=0, is_buffer=t.is_buffer)


def _autotp_class(name: str, allreduce: Tuple[str, ...], tp: int, layer=None) -> str:
    """Which module AutoTP's `_replace` turns a Linear into (the routing rules of auto_tp.py)."""
    from deepspeed.module_inject.fusedqkv_utils import require_tp_fused_qkvw

    layer_type = str(type(layer)) if layer is not None else ""
    if (
        name in ("mlp.gate", "block_sparse_moe.gate")
        or "q_a_proj" in name
        or "kv_a_proj_with_mqa" in name
        or (name == "mlp.shared_expert_gate" and "qwen2_moe" in layer_type)
    ):
        return "skip"
    if "gate_up_proj" in name or ("dense_h_to_4h" in name and "GLM" in str(layer)):
        return "GateUpPack_LinearLayer"
    if name in allreduce or "down_proj" in name or ("Arctic" in str(layer) and "w2" in name):
        return "LinearAllreduce"
    return "fused_LinearLayer" if require_tp_fused_qkvw(name, tp) else "LinearLayer"


def _kernel_inject(model, tensors, tp: int, notes: List[str]):
    classes = set(kernel_policy_classes())
    layers = {n: type(m).__name__ for n, m in model.named_modules() if type(m) in classes}
    if not layers:
        names = sorted(
            {type(m).__name__ for m in model.modules() if "Layer" in type(m).__name__ or "Block" in type(m).__name__}
        )
        notes.append(
            f"kernel injection has no policy for {', '.join(names) or 'any layer class'}: "
            f"no module is replaced and nothing is sharded"
        )
        return [replicated(t, tp) for t in tensors], unchanged()
    notes.append(
        "kernel-injected layers: matrices assumed split evenly 1/tp (DeepSpeed containers); "
        "the kernel workspace is not part of the weights"
    )
    out = []
    for t in tensors:
        in_layer = any(t.module == n or t.module.startswith(n + ".") for n in layers)
        if in_layer and len(t.shape) == 2 and tp > 1 and not t.is_buffer:
            out.append(split(t, 0, even(t.shape[0], tp), "kernel"))
        else:
            out.append(replicated(t, tp))
    return out, {"removed": dict(Counter(layers.values())), "added": {}}


def _zero3(model, tensors, s: Strategy, tp: int, notes: List[str], found: Optional[Dict[str, Any]] = None):
    """ZeRO-3: each parameter's flat partition is ceil(numel / world) elements on every rank."""
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


def _autotp_zero3(model, tensors, s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    """AutoTP + ZeRO-3 (deepspeed.initialize, tensor_parallel.autotp_size = tp): the model is loaded under zero.Init
    over all ranks; with a policy, dsexp passes it as a partition_config, and AutoTP gathers each Linear of the policy
    layers and keeps its shard (plain LinearLayer / LinearAllreduce: no fused-qkv or gate-up layouts, no lm_head),
    which ZeRO-3 then partitions over the data-parallel group of world / tp = 1 rank. Everything else keeps its
    ZeRO-3 partition (1/tp; a tied weight once), buffers whole."""
    zero, _ = _zero3(model, tensors, s, tp, notes)
    if not s.policy:  # DeepSpeed's own choice (the model's tp_plan or its parser): modelled as ZeRO-3 alone
        notes.append(
            "autotp_zero3 without a policy modelled as ZeRO-3 partitioning over all ranks (parameters 1/tp, "
            "buffers whole); the module replacements are AutoTP's"
        )
        _, modules = _autotp(model, tensors, s, tp, [], found)
        return zero, modules
    import torch.nn as nn
    from deepspeed.inference.config import DeepSpeedTPConfig
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    from dsexp.models.policy import ds_name as policy_name

    rules = autotp_rules(model, s, tp, notes, found)
    meta = AutoTPMeta.from_model_config(model.config, DeepSpeedTPConfig().tp_grain_size)
    by_module: Dict[str, Tuple[str, str]] = {}
    for lname, layer in model.named_modules():
        rows = rules.get(type(layer).__name__)
        if rows is None:
            continue
        for rel, child in layer.named_modules():
            if rel and isinstance(child, nn.Linear):
                row = rel in rows or policy_name(rel) in rows
                by_module[f"{lname}.{rel}"] = (rel, "LinearAllreduce" if row else "LinearLayer")
    out = [
        _autotp_place(t, *by_module[t.module], None, tp, meta) if t.module in by_module and not t.is_buffer else z
        for t, z in zip(tensors, zero)
    ]
    notes.append(
        "autotp_zero3 with a policy: the policy layers' Linears hold their AutoTP shards (row-parallel biases whole), "
        "every other parameter its ZeRO-3 partition (1/tp), buffers whole"
    )
    replaced = Counter(cls for _, cls in by_module.values())
    return out, {"removed": {"Linear": sum(replaced.values())} if replaced else {}, "added": dict(replaced)}


_HF_DIMS = (  # style prefix -> the dim its DTensor shards ("out": the output dim, ndim - 2; -1 for a bias)
    ("embedding_colwise", 1),
    ("embedding_rowwise", 0),
    ("packed_colwise", "out"),
    ("packed_rowwise", -1),
    ("colwise", "out"),
    ("rowwise", -1),
)


def _hf_tp(model, tensors, s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    """transformers TP: the model's resolved plan; DTensor Shard(dim) cuts like torch.chunk."""
    if tp == 1:
        return [replicated(t, tp) for t in tensors], unchanged()
    if not tp_plan(model):  # transformers refuses at load (InternLM2's code as published has no plan)
        raise AssertionError("the model's code defines no tensor-parallel plan: transformers' TP cannot shard it")
    style_of = _hf_plan(model, tp)
    out = []
    for t in tensors:
        style = style_of(t.name)
        dim = next((d for prefix, d in _HF_DIMS if style and style.startswith(prefix)), None)
        if dim is None or t.is_buffer or (dim == -1 and len(t.shape) == 1):  # row-parallel bias: replicated
            out.append(replicated(t, tp))
        else:
            d = max(len(t.shape) - 2, 0) if dim == "out" else dim % len(t.shape)
            out.append(split(t, d, chunks(t.shape[d], tp), style))
    return out, unchanged()


def _hf_plan(model, tp: int) -> Callable[[str], Optional[str]]:
    """tensor name -> its TP style: the resolved per-parameter plan (transformers >= 5.2x), else the model's plan
    with layer wildcards, matched as transformers 5.17 does (`_get_parameter_tp_plan`: the parameter, else its
    module)."""
    resolve = getattr(model, "_resolve_parallel_plans", None)
    if resolve is not None:
        from transformers.distributed import DistributedConfig

        return resolve(DistributedConfig(tp_size=tp))[0].get
    from transformers.distributed.tensor_parallel import _get_parameter_tp_plan

    plan = dict(getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None) or {})
    return lambda name: _get_parameter_tp_plan(name, plan, is_weight=True)


def _unknown_engine(model, tensors, s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    notes.append(f"no placement rule for engine {s.engine!r}: predicted as unsharded")
    return [replicated(t, tp) for t in tensors], unchanged()


PLACERS: Dict[str, Placer] = {
    "init_inference": _init_inference,
    "zero_inference": _zero3,
    "autotp_zero3": _autotp_zero3,
    "hf_tp": _hf_tp,
}


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
    rank0 = next((r for r in result.get("ranks") or [] if r), None)
    prompt = (rank0 or {}).get("generate", {}).get("prompt_ids")
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
    for rk in result.get("ranks") or []:
        phases = (rk or {}).get("phases") or {}
        start = (phases.get("start") or {}).get("gpu") or {}
        outside = [
            g["nvml_process_used"] - (g.get("gpu_reserved") or 0)
            for g in ((ph or {}).get("gpu") or {} for ph in phases.values())
            if g.get("nvml_process_used")
        ]
        reserve = device_reserve(result, rk or {})
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
    """Ranks sharing GPUs (spec.launcher.gpus): does the busiest GPU hold its ranks? Each rank's weights and KV cache
    (the memory model) plus a CUDA context per rank, against the GPU's `total` bytes. None where the model cannot
    predict (the run will say)."""
    from dataclasses import asdict

    try:
        pred = predict({"config": asdict(spec), "runtime": {"device": "cuda"}})
    except Exception:
        return None
    per_node, gpus = spec.ranks_per_node, int(spec.launcher.gpus)
    busiest = [r for r in range(per_node) if r % gpus == 0]  # GPU 0 of the first node: local ranks 0, gpus, ...
    held = sum(pred.weights[r] + pred.kv_cache[r] for r in busiest)
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
