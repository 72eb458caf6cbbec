"""init_inference in the memory model.

Without kernel injection (AutoTP, also with a user injection policy, or the one `engine.injection_policy=infer` finds,
dsexp.models.policy): inside each policy layer every nn.Linear is split, column-parallel (LinearLayer, out dim) or
row-parallel (LinearAllreduce, in dim, bias replicated), with DeepSpeed's `get_shard_size_list` (KV-head units for
attention, 64-grain near-even splits for MLP); fused qkv (`qkv_proj`, `query_key_value`, `c_attn`, ...) is cut by
DeepSpeed's own `prepare_tp_fused_qkvw` for the layer's fused layout (bloomtype rows, phi3type q/k/v each,
bigcodetype q split + kv whole, ...), a fused `gate_up_proj` as two halves (GateUpPack_LinearLayer), an nn.Embedding
inside a layer on its hidden dim; MoE routers (`mlp.gate`, qwen2_moe's `shared_expert_gate`) stay whole, and so do
MoE experts stored as 3-D parameters (no Linear for AutoTP to replace); a top-level `lm_head`/`embed_out` (or, with
trim.shard_head, the head whatever its name) becomes LmHeadLinearAllreduce (split on the hidden dim), which clones a
tied weight first: the embedding stays whole and the head is a new [V, H/tp] tensor (a `copy` placement, not part of
the model's bytes); with trim.shard_embedding the input embedding becomes a VocabParallelEmbedding; everything else
(embeddings, a head named otherwise, norms, rotary buffers) stays replicated. tp=1 without a policy shards nothing.

With kernel injection: layers whose class has a DeepSpeed policy have their matrices split 1/tp; without a matching
policy (e.g. InternLM2) nothing is sharded.

The AutoTP rules here are also autotp_zero3's (dsexp.engines.autotp_zero3.placement).

`allocation_order`: the order AutoTP puts a rank's tensors on the GPU, which the allocator's reserve depends on
(dsexp.predict.allocator). `init_fails`: where DeepSpeed's own AutoTP init refuses the model (run on the meta device
as each rank), which these rules would otherwise place as if it ran.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections import Counter
from typing import Any, Dict, Iterator, List, Optional, Tuple

from dsexp.core.compat import installed
from dsexp.core.schema import TORCH_DTYPE_NAMES
from dsexp.engines.base import INFER
from dsexp.models.kernel_policy import kernel_policy_classes
from dsexp.predict.placements import Placement, Strategy, Tensor, even, itemsize, replicated, split, unchanged
from dsexp.trims.shard_embedding.placement import embedding_to_split
from dsexp.trims.shard_head import HEAD_NAMES
from dsexp.trims.shard_head.placement import aliased_head


def place(model, tensors: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    if s.kernel_inject:
        return kernel_inject(model, tensors, tp, notes)
    return autotp(model, tensors, s, tp, notes, found)


# --- AutoTP ----------------------------------------------------------------------------------------------------


def allocation_order(placements: List[Placement], rank: int, s: Strategy) -> Optional[List[int]]:
    """Bytes of each tensor this rank allocates on the GPU, in AutoTP's order: each split tensor as the engine cuts it
    walking the model (DeepSpeed's `move`), then the rest as `module.to(device)` moves them; the replay of this order
    equals every rank's reserve after init on the H200 (results/h200/shared). None: kernel injection builds its fused
    layers in an order not modelled."""
    if s.kernel_inject:
        return None
    if s.quant and s.quant_order == "stream":  # each linear moved and quantized in turn (its values, then its
        # scales, the cache emptied after each: quant.empty_cache=each), then the rest as module.to moves it
        ordered = sorted((p for p in placements if p.parts), key=lambda p: not p.first)  # quant.head_first
        quantized = [n for p in ordered for n in p.parts[rank]]
        return [*quantized, *(p.local[rank] for p in placements if not p.parts)]
    split_now = [p.local[rank] for p in placements if p.how != "replicated"]
    moved_later = [p.local[rank] for p in placements if p.how == "replicated"]
    return [*split_now, *moved_later]


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


def autotp(model, tensors: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    """DeepSpeed AutoTP as `replace_wo_policy` + `set_lm_head` apply it (deepspeed/module_inject)."""
    rules = autotp_rules(model, s, tp, notes, found)
    if rules is None:
        return [replicated(t, tp) for t in tensors], unchanged()
    meta = autotp_meta(model)
    by_module = _replacements(model, rules, tp)
    head = _split_head(model, s, tp, notes)
    if head:
        by_module[head] = ("lm_head", "LmHeadLinearAllreduce", None)
    embedding = embedding_to_split(model, s, tp)
    if embedding:
        by_module[embedding] = (embedding, "VocabParallelEmbedding", None)  # named as the rank names it: its module
    out = []
    for t in tensors:
        name, cls, layer = by_module.get(t.module, (None, None, None))
        out.append(autotp_place(t, name, cls, layer, tp, meta))
    if head and not any(t.module == head and t.name.endswith(".weight") for t in tensors):
        out.append(_cloned_head(model, head, s, tp, meta, notes))
    replaced = Counter(cls for _, cls, _ in by_module.values() if cls not in ("skip", "Embedding"))
    removed = Counter({"Linear": sum(n for cls, n in replaced.items() if cls != "VocabParallelEmbedding")})
    removed["Embedding"] = replaced.get("VocabParallelEmbedding", 0)
    return out, {"removed": {k: n for k, n in removed.items() if n}, "added": dict(replaced)}


def _replacements(model, rules: Dict[str, tuple], tp: int) -> Dict[str, Tuple[str, str, Any]]:
    """module name -> (DeepSpeed's name for it, replacement class, the decoder layer it sits in), inside the policy
    layers."""
    import torch.nn as nn

    from dsexp.models.policy import ds_name as policy_name

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
    return by_module


def _split_head(model, s: Strategy, tp: int, notes: List[str]) -> Optional[str]:
    """The top-level head AutoTP's set_lm_head splits: one named lm_head/embed_out, else (trim.shard_head) the head
    aliased as lm_head."""
    import torch.nn as nn

    head = next((n for n in HEAD_NAMES if isinstance(getattr(model, n, None), nn.Linear)), None)
    if head and s.deepspeed_before(0, 15) and s.load != "meta":
        # DeepSpeed 0.14 calls set_lm_head only when init_inference loads a checkpoint (replace_module.py)
        notes.append(
            f"DeepSpeed {s.deepspeed} splits the head ({head}) only with checkpoint= (load=meta): it stays whole"
        )
        head = None
    return head or aliased_head(model, s, tp)


def _cloned_head(model, head: str, s: Strategy, tp: int, meta, notes: List[str]) -> Placement:
    """A head tied to the embedding: LmHeadLinearAllreduce clones the weight, then keeps its [V, H/tp] slice."""
    w = getattr(model, head).weight
    clone = Tensor(f"{head}.weight", head, w.numel(), tuple(w.shape), itemsize(w, s), False)
    copy = autotp_place(clone, "lm_head", "LmHeadLinearAllreduce", None, tp, meta)
    copy.copy, copy.how = True, "LmHeadLinearAllreduce (clone of the tied embedding)"
    notes.append(
        f"the head is tied to the embedding: AutoTP clones it ({head}.weight split on the hidden dim, "
        "a new tensor) and the embedding stays whole"
    )
    return copy


def autotp_place(t: Tensor, name: Optional[str], cls: Optional[str], layer, tp: int, meta) -> Placement:
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


# --- kernel injection ------------------------------------------------------------------------------------------


def kernel_inject(model, tensors: List[Tensor], tp: int, notes: List[str]):
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


# What DeepSpeed's AutoTP divides by tp on the modules around the linears it splits (AutoTP.update_mp_params), so
# that their forward reshapes to the rank's heads
MP_PARAMS = ("n_heads", "inner_dim", "num_heads", "num_kv", "num_attention_heads", "num_attn_heads", "all_head_size",
             "embed_dim", "hidden_size", "num_key_value_heads", "num_kv_heads", "kv_n_heads", "d_model",
             "num_attention_heads_per_partition", "num_multi_query_groups_per_partition",
             "hidden_size_per_partition")  # fmt: skip


def rank_model(model, s: Strategy, placements: List[Placement], rank: int, tp: int):
    """A copy of the meta model as AutoTP leaves rank `rank` of tp (no kernel injection, no trims): each split
    linear's weight (and bias) cut to the rank's rows or columns, and the module around it told its share of the
    heads, as update_mp_params does. Its generate can then be traced on the meta device (dsexp.predict.meta_trace).
    A head split on its hidden dim (LmHeadLinearAllreduce) also slices its input, as DeepSpeed's does. At tp=1
    nothing is split, but with an injection policy DeepSpeed still wraps each linear of the policy layers in its
    own (a GPT-2 block's Conv1D as a Linear, whose generate then fails): DeepSpeed's own init makes that model."""
    import torch

    if tp == 1:
        try:
            rules = autotp_rules(model, s, 1, [], {})
        except AssertionError:  # DeepSpeed finds no policy: the placement says so; nothing is wrapped
            rules = None
        return rank_init(model, rules, s, 1, 0) if rules else copy.deepcopy(model)
    model = copy.deepcopy(model)
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    around = set()
    for p in placements:
        t = params.get(p.name)
        if p.dim is None or t is None or p.copy:
            continue
        shape = list(t.shape)
        cut = (p.run_local or p.local)[rank]  # a quantized weight's cut, in the run dtype it was made in
        shape[p.dim] = cut // (t.element_size() * (t.numel() // t.shape[p.dim]))
        owner, name = p.name.rsplit(".", 1)
        setattr(modules[owner], name, torch.nn.Parameter(torch.empty(shape, device="meta", dtype=t.dtype), False))
        around.add(owner.rsplit(".", 1)[0] if "." in owner else owner)
        if p.dim == 1 and p.how.startswith("LmHead"):
            _slice_input(modules[owner], sum(p.local[:rank]) // (t.element_size() * t.shape[0]), shape[1])
    share = _mp_share(model, tp, rank)
    for name in around:
        for attr in MP_PARAMS:
            value = getattr(modules[name], attr, None)
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(modules[name], attr, share(value, name))
    return model


def _mp_share(model, tp: int, rank: int):
    """A module attribute's share on rank `rank`, as update_mp_params computes it: by KV heads where the model has
    them (uneven where tp does not divide them: tp=3 of 8 KV heads gives 3, 3, 2), else near even; (value, module
    name) -> int."""
    from deepspeed.module_inject.tp_shard import get_shard_size

    meta = autotp_meta(model)
    return lambda value, name: get_shard_size(value, tp, meta, name, rank=rank)


def autotp_meta(model):
    """The KV heads and grain AutoTP splits this model by (DeepSpeed's AutoTPMeta, the default tp_grain_size)."""
    from deepspeed.inference.config import DeepSpeedTPConfig
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    return AutoTPMeta.from_model_config(model.config, DeepSpeedTPConfig().tp_grain_size)


def _slice_input(head, start: int, width: int) -> None:
    """LmHeadLinearAllreduce's forward on the head: the rank's columns of the input times its weight, then (after
    the all-reduce) the bias added in place, so a biased head makes no second logits tensor."""
    import torch

    def forward(x):
        out = torch.matmul(x[..., start : start + width], head.weight.transpose(-1, -2))
        if head.bias is not None:
            out += head.bias
        return out

    head.forward = forward


# --- DeepSpeed's own init on the meta device --------------------------------------------------------------------
# Each rank's init is `replace_transformer_layer` over the model's policy layers (the engine's three modes: a user's
# policy, the one `engine.injection_policy=infer` finds, or AutoTP's parser), in a process group of tp ranks that
# carries no data (torch's "fake" backend), on a copy of the meta model; DeepSpeed keeps meta tensors on the meta
# device (`TensorParallel_Layer.move`), so nothing is allocated and a 20B model takes about a second. Where DeepSpeed's
# own split code refuses a tensor's shape (GPT-2's Conv1D c_attn under DeepSpeed 0.19), the run's init raises the
# same error, and the plan says so instead of predicting the memory of a run that cannot start.


def init_fails(model, s: Strategy, tp: int) -> Optional[str]:
    """Why DeepSpeed's AutoTP init raises for this model at tp (the first rank that fails and DeepSpeed's error), or
    None: it gets through on every rank, or the check does not apply (kernel injection, tp=1: nothing is split; a
    stack pinning another DeepSpeed than this environment's: its own init code decides; a process group already up
    in this process)."""
    import torch.distributed as tdist

    if s.kernel_inject or tp < 2 or (s.deepspeed and s.deepspeed != installed("deepspeed")) or tdist.is_initialized():
        return None
    rules = autotp_rules(model, s, tp, [], {})
    key = (type(model).__name__, model.config.to_json_string(), json.dumps(rules, sort_keys=True), s.dtype, tp)
    if key not in _INIT_VERDICTS:  # what DeepSpeed's init reads does not change with the load or the trims
        _INIT_VERDICTS[key] = _first_failing_rank(model, rules, s, tp)
    return _INIT_VERDICTS[key]


_INIT_VERDICTS: Dict[tuple, Optional[str]] = {}


def _first_failing_rank(model, rules: Dict[str, Tuple[str, ...]], s: Strategy, tp: int) -> Optional[str]:
    with one_layer_of_each_kind(model, rules):
        return _first_failing(model, rules, s, tp)


def _first_failing(model, rules: Dict[str, Tuple[str, ...]], s: Strategy, tp: int) -> Optional[str]:
    for rank in range(tp):
        try:
            rank_init(model, rules, s, tp, rank)
        except Exception as e:  # DeepSpeed's own error, as the run's init raises it
            first = (str(e).strip().splitlines() or [""])[0]
            return (f"DeepSpeed's AutoTP init fails on rank {rank} of {tp} (run on the meta device; a run is "
                    f"expected to fail there too): {type(e).__name__}: {first}")  # fmt: skip
    return None


@contextlib.contextmanager
def one_layer_of_each_kind(model, rules: Dict[str, Tuple[str, ...]]) -> Iterator[None]:
    """The model's lists of policy layers cut, while in the block, to the first layer of each structure (its modules'
    classes, its tensors' shapes and dtypes): DeepSpeed's init does to each layer what it does to every layer of that
    structure, so an 80-layer model's init runs on one layer, not 80 (a model alternating MoE and dense layers, on
    two)."""
    import torch.nn as nn

    cut = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and any(type(m).__name__ in rules for m in child):
                kept, seen = [], set()
                for layer in child:
                    if layer_structure(layer) not in seen:
                        seen.add(layer_structure(layer))
                        kept.append(layer)
                cut.append((parent, name, child))
                parent._modules[name] = nn.ModuleList(kept)
    try:
        yield
    finally:
        for parent, name, child in cut:
            parent._modules[name] = child


def layer_structure(layer) -> tuple:
    modules = tuple((n, type(m).__qualname__) for n, m in layer.named_modules())
    tensors = tuple((n, tuple(t.shape), t.dtype) for n, t in [*layer.named_parameters(), *layer.named_buffers()])
    return type(layer).__qualname__, modules, tensors


def rank_init(model, rules: Dict[str, Tuple[str, ...]], s: Strategy, tp: int, rank: int):
    """A copy of the meta model after DeepSpeed's AutoTP init as rank `rank` of tp runs it (InferenceEngine's
    policy loop: each policy layer class with its row-parallel names, then the head)."""
    import torch
    from deepspeed.inference.config import DeepSpeedInferenceConfig
    from deepspeed.module_inject.replace_module import replace_transformer_layer

    model = copy.deepcopy(model)
    classes = {type(m).__name__: type(m) for m in model.modules()}
    dtype = getattr(torch, TORCH_DTYPE_NAMES[s.dtype])
    config = DeepSpeedInferenceConfig(
        tensor_parallel={"tp_size": tp}, dtype=dtype, replace_with_kernel_inject=False,
        max_out_tokens=s.max_out_tokens,
    )  # fmt: skip
    with fake_world(tp, rank) if tp > 1 else contextlib.nullcontext() as group:  # tp=1: the engine makes no group
        config.tensor_parallel.tp_group = group
        for name, row_parallel in rules.items():
            config.injection_policy_tuple = tuple(row_parallel)
            replace_transformer_layer(classes[name], model, None, config, model.config)
    return model


@contextlib.contextmanager
def fake_world(tp: int, rank: int) -> Iterator[object]:
    """This process as rank `rank` of a world of tp that moves no data (torch's fake process group), with
    DeepSpeed's communication backend on it; the tp group DeepSpeed's layers read their rank and size from. Both
    are taken down after, and torch's rank-prefixing excepthook with them. DeepSpeed's CPU shared-memory op is not
    built: nothing is ever reduced here."""
    import sys
    from unittest import mock

    import deepspeed.comm.comm as ds_comm
    import torch.distributed as tdist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    saved, hook = ds_comm.cdb, sys.excepthook
    tdist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=tp)
    try:
        with mock.patch("deepspeed.comm.torch.build_shm_op", return_value=None):
            ds_comm.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, verbose=False)
        yield ds_comm.new_group(list(range(tp)))
    finally:
        ds_comm.cdb, sys.excepthook = saved, hook
        tdist.destroy_process_group()
