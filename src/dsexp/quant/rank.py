"""The quant family on a rank, called by dsexp's pipeline (dsexp.rank.workloads.pipeline) around the engine:
`before_load` (DeepSpeed's members: the block zero.Init reads; torchao's in stream order: the engine keeps the model
on the host), `quantize` after the engine (torchao's members), `generate_kwargs` (the quantized KV cache). Imported on
ranks only."""

from __future__ import annotations

from typing import Any, Dict, Optional

from dsexp.core.context import RankContext
from dsexp.quant import AFTER, STREAM, group_size, order_of, traits
from dsexp.quant import kv as kv_member


def member(ctx: RankContext):
    return traits(ctx.spec.quant.name)


def before_load(ctx: RankContext, engine) -> Dict[str, Any]:
    """Settings the member needs before the model is loaded and placed; returns what was set (for the record)."""
    t = member(ctx)
    if t is None:
        return {}
    if t.library == "deepspeed":
        from dsexp.quant.deepspeed_rank import ds_block

        if not hasattr(engine, "config_extra"):  # quant.check_composition=false: say so rather than run unquantized
            raise RuntimeError(
                f"quant={t.key}: engine={ctx.spec.engine.name} takes no DeepSpeed config; DeepSpeed's weight "
                "quantization is a ZeRO-3 config block (weight_quantization), read by zero.Init only"
            )

        block = ds_block(t, group_size(ctx.spec.quant))
        engine.config_extra = block  # merged into the ZeRO-3 config (dsexp.engines.zero_inference.rank)
        return {"ds_config": block}
    if order_of(ctx.spec.quant) == STREAM and can_stream(ctx):
        ctx.spec.engine.keep_module_on_host = True  # the linears reach the GPU one at a time, quantized
        return {"engine.keep_module_on_host": True}
    return {}


def can_stream(ctx: RankContext) -> bool:
    """Whether the engine can leave the model on the host for its linears to reach the GPU one at a time, quantized
    (init_inference's keep_module_on_host, on a GPU)."""
    return ctx.on_gpu and ctx.spec.engine.name == "init_inference"


def at_load(ctx: RankContext) -> bool:
    """torchao's members under transformers' own tensor parallelism (engine=hf_tp): transformers quantizes each
    weight as from_pretrained loads and shards it (its TorchAoConfig), the one order that composes there (quantize_
    after it leaves plain tensors beside the DTensors: "aten.mm.default got mixed torch.Tensor and DTensor")."""
    t = member(ctx)
    hf_tp = ctx.spec.engine.name == "hf_tp" and ctx.spec.quant.order != AFTER  # after: quant.check_composition=false
    return t is not None and t.library == "torchao" and hf_tp


def load_kwargs(ctx: RankContext) -> Dict[str, Any]:
    """from_pretrained's quantization_config where transformers quantizes as it loads (at_load); else {}."""
    if not at_load(ctx):
        return {}
    from transformers import TorchAoConfig

    from dsexp.quant.torchao_rank import torchao_config

    t = member(ctx)
    return {"quantization_config": TorchAoConfig(quant_type=torchao_config(t, group_size(ctx.spec.quant)))}


def quantizes_after_engine(ctx: RankContext) -> bool:
    t = member(ctx)
    return t is not None and t.library == "torchao" and not at_load(ctx)


def quantize(module, ctx: RankContext) -> Dict[str, Any]:
    """torchao's members, after the engine placed the model (dsexp.quant.torchao_rank)."""
    from dsexp.quant.torchao_rank import quantize as torchao_quantize

    order = order_of(ctx.spec.quant)
    if order == STREAM and not can_stream(ctx):
        order = "after"  # the engine already placed the model on its device: nothing left to stream
    q = ctx.spec.quant
    return torchao_quantize(
        module, member(ctx), group_size(q), order, ctx.device, q.empty_cache, q.head, q.head and q.head_first
    )


def after_load(module, ctx: RankContext) -> Optional[Dict[str, Any]]:
    """What was quantized while the model loaded: DeepSpeed's members (zero.Init), torchao's under hf_tp."""
    t = member(ctx)
    if t is not None and at_load(ctx):
        from dsexp.core.tensors import is_wrapper

        names = [n for n, p in module.named_parameters() if is_wrapper(getattr(p, "_local_tensor", p))]
        how = "from_pretrained(quantization_config=TorchAoConfig(quant_type=...)): transformers quantizes as it loads"
        return {"member": t.key, "library": "torchao", "call": how, "order": STREAM, "linears": len(names)}
    if t is None or t.library != "deepspeed":
        return None
    from dsexp.quant.deepspeed_rank import quantized_weights

    return {"member": t.key, "library": "deepspeed", "call": t.call, "order": STREAM, **quantized_weights(module)}


def generate_kwargs(ctx: RankContext) -> Dict[str, Any]:
    return kv_member.generate_kwargs(ctx.spec.quant)
