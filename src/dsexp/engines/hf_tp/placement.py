"""hf_tp in the memory model: the model's own transformers TP plan (DTensor shards, torch.chunk sizes): colwise and
packed_colwise cut the output dim (dim 0 of a Linear weight, dim 1 of a 3-D expert parameter), rowwise the last dim
(biases replicated), embeddings dim 0 (rowwise) or 1 (colwise); a tied embedding/head is one tensor."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional

from dsexp.models.kernel_policy import tp_plan
from dsexp.predict.placements import Strategy, Tensor, chunks, replicated, split, unchanged

_HF_DIMS = (  # style prefix -> the dim its DTensor shards ("out": the output dim, ndim - 2; -1 for a bias)
    ("embedding_colwise", 1),
    ("embedding_rowwise", 0),
    ("packed_colwise", "out"),
    ("packed_rowwise", -1),
    ("colwise", "out"),
    ("rowwise", -1),
)


def place(model, tensors: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
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
