"""The engines (`engine=` group) and what each does to a model: the one table that validation, the ranks,
the memory model and the matrix read. `tests/test_layout.py` checks that it, `conf/engine/*.yaml` and the
memory model's placers name the same engines, and that every `impl` is a rank-side Engine of that name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union


@dataclass(frozen=True)
class EngineTraits:
    name: str
    impl: str  # "module:Class" of the rank-side Engine (imported only on the ranks)
    splits_weights: bool  # tensor parallelism: each rank keeps its slice of the weights and its own KV heads
    zero3: bool  # built on deepspeed.initialize with ZeRO stage 3 (needs zero.stage=3)
    even_heads: bool  # splits attention rows evenly: tp must divide the KV heads
    casts_buffers: bool  # casts the whole module, buffers included, to the run dtype
    fills_meta: bool  # can place a model built on the meta device (load=meta|sharded)
    summary: str
    inference_autotp: bool = False  # runs init_inference's AutoTP, whose call the AutoTP trims change (dsexp.trims)


_RANK = "dsexp.rank.engines"
ENGINES: Dict[str, EngineTraits] = {
    t.name: t
    for t in (
        EngineTraits(
            "init_inference",
            f"{_RANK}.init_inference:InitInference",
            splits_weights=True,
            zero3=False,
            even_heads=False,
            casts_buffers=True,
            fills_meta=True,
            inference_autotp=True,
            summary="deepspeed.init_inference: kernel injection, or AutoTP with an injection policy",
        ),
        EngineTraits(
            "zero_inference",
            f"{_RANK}.zero_inference:ZeroInference",
            splits_weights=False,
            zero3=True,
            even_heads=False,
            casts_buffers=False,
            fills_meta=False,
            summary="deepspeed.initialize with ZeRO stage 3, partitioned while loading",
        ),
        EngineTraits(
            "autotp_zero3",
            f"{_RANK}.autotp_zero3:AutoTPZero3",
            splits_weights=True,
            zero3=True,
            even_heads=True,
            casts_buffers=False,
            fills_meta=False,
            summary="AutoTP + ZeRO-3 through deepspeed.initialize (tensor_parallel.autotp_size)",
        ),
        EngineTraits(
            "hf_tp",
            f"{_RANK}.hf_tp:HfTP",
            splits_weights=True,
            zero3=False,
            even_heads=True,
            casts_buffers=False,
            fills_meta=False,
            summary="transformers' tensor parallelism (tp_plan='auto'), no DeepSpeed",
        ),
    )
}


def traits(name: str) -> EngineTraits:
    if name not in ENGINES:
        raise KeyError(f"engine={name!r} is not implemented; available: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


INFER = "infer"  # engine.injection_policy=infer: dsexp finds the policy (dsexp.models.policy) on the model itself


def effective_policy(
    injection_policy: Any, kernel_inject: bool, model_policy: Optional[Dict[str, List[str]]]
) -> Union[None, str, Dict[str, List[str]]]:
    """The AutoTP injection policy an engine applies. `auto`: the model preset's policy whenever kernel
    injection is off; null: none (DeepSpeed's own parser); `infer`: INFER, resolved on the model itself by
    dsexp.models.policy.infer_policy (known layouts, DeepSpeed's parser, the module structure; a model preset's
    policy is not used); else the user's {layer class: [linears]}."""
    if injection_policy == "auto":
        return None if kernel_inject else (dict(model_policy) if model_policy else None)
    if injection_policy == INFER:
        return None if kernel_inject else INFER
    return dict(injection_policy) if injection_policy else None
