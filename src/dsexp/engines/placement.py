"""The engines' and trims' rules in the memory model, dispatched: the engine member's `placement.place`, then the
trims' rules over its placements, and the order the engine allocates in. The memory model (dsexp.predict) knows no
member; whoever predicts a job hands this module to it as its rules (dsexp.predict.job.predict(config, RULES)), which
also says the strategy a config runs (`strategy_of`: the engine's traits, the trims that are on)."""

from __future__ import annotations

import sys
from typing import Any, Dict, List, Mapping, Optional

from dsexp.engines import ENGINES, part
from dsexp.engines.base import effective_policy
from dsexp.predict.job import NOT_REPORTED, Facts, device_of, version
from dsexp.predict.placements import Placement, Placer, Strategy, Tensor, replicated, tensors, unchanged
from dsexp.predict.weights_per_rank import AllocationOrder
from dsexp.quant import placement as quant_placement
from dsexp.trims import active as active_trims
from dsexp.trims import last_position_logits
from dsexp.trims.dedupe_buffers import placement as dedupe


def placer(engine: str) -> Placer:
    """The engine member's placement rule; an engine dsexp does not know (a script's) keeps every tensor whole."""
    return part(engine, "placement").place if engine in ENGINES else _unknown_engine


def _unknown_engine(model, held: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    notes.append(f"no placement rule for engine {s.engine!r}: predicted as unsharded")
    return [replicated(t, tp) for t in held], unchanged()


def allocation_order(engine: str) -> Optional[AllocationOrder]:
    """The order the engine puts a rank's tensors on the GPU (the member's `placement.allocation_order`); None where
    it does not say."""
    return getattr(part(engine, "placement"), "allocation_order", None) if engine in ENGINES else None


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
    placements = quant_placement.quantize(model, placements, strategy, tp, notes)
    out = (placements, modules, notes, error)
    return (*out, found or None) if with_policy else out


def shared_buffers(source: Dict[str, Any], strategy: Strategy) -> Optional[Dict[str, str]]:
    """With trim.dedupe_buffers on, the buffers that share an identical one; else None."""
    return dedupe.shared_buffers(source, strategy)


def allocator_reserve(placements: List[Placement], rank: int, s: Strategy):
    """The caching allocator's reserve for this rank's weights (a dsexp.predict.allocator.Reserve), replaying the
    engine's allocations in its order; None where the engine does not say its order."""
    from dsexp.predict.allocator import replay

    order = allocation_order(s.engine)
    sizes = order(placements, rank, s) if order else None
    return replay(sizes) if sizes is not None else None


def strategy_of(config: Mapping[str, Any], facts: Facts) -> Strategy:
    """The settings that decide placement, as the job was configured and, where it ran, as its ranks reported."""
    from dsexp.core.schema import EngineConfig

    model, eng, zero, load = (config.get(k) or {} for k in ("model", "engine", "zero", "load"))
    dtype, model_dtype = config.get("dtype") or model.get("dtype", "bf16"), model.get("dtype", "bf16")
    conversion = facts.conversion
    if conversion is NOT_REPORTED:
        conversion = f"{model_dtype}->{dtype}" if dtype != model_dtype else None
    name = eng.get("name", EngineConfig.name)
    traits = ENGINES.get(name)
    trim = config.get("trim") or {}
    return Strategy(
        engine=name,
        kernel_inject=bool(eng.get("kernel_inject")),
        policy=_policy_used(config, facts),
        zero_stage=int(zero.get("stage") or 0),
        offload=zero.get("offload") or "none",
        dtype=dtype,
        model_dtype=model_dtype,
        load=load.get("name", "eager"),
        fmt=load.get("format", "safetensors"),
        device=device_of(config, facts),
        max_out_tokens=int(eng.get("max_out_tokens") or 0),
        conversion=conversion,
        restore_buffers=load.get("restore_buffers", True) is not False,
        trims=dict.fromkeys(active_trims(trim), True),
        deepspeed=version(config, facts, "deepspeed"),
        transformers=version(config, facts, "transformers"),
        casts_buffers=bool(traits and traits.casts_buffers),
        splits_weights=bool(traits and traits.splits_weights),
        expandable_segments="expandable_segments:true" in alloc_conf(config).replace(" ", "").lower(),
        last_position_logits=last_position_logits(trim),
        **quant_fields(config.get("quant") or {}),
    )


def quant_fields(q: Mapping[str, Any]) -> Dict[str, Any]:
    """The Strategy's quant fields from a config's `quant` group (dsexp.quant)."""
    from dsexp.quant import group_size, order_of, traits

    t = traits(q.get("name") or "none")
    dequantizes = None
    if t is not None and t.forward == "dequantize":  # fp8 multiplies in fp8, tinygemm reads int4's packed weight
        dequantizes = "gathered" if t.library == "deepspeed" else "layer"
    return {
        "quant": t.key if t else None,
        "quant_group": group_size(q),
        "dequantizes": dequantizes,
        "quantizes_activations": bool(t and t.forward == "fp8"),
        "kv_bits": q.get("kv"),
        "kv_group": int(q.get("kv_group_size") or 64),
        "kv_residual": int(q.get("kv_residual") if q.get("kv_residual") is not None else 128),
        "quant_max_output": t.max_output_elements if t else None,
        "quant_max_output_why": t.max_output_why if t else "",
        "quant_order": order_of(q) if t else "stream",
        "quant_empty_cache": q.get("empty_cache") or "each",
        "quant_head": bool(t and q.get("head")),
        # a run recorded before the key existed quantized in the model's order (the head last)
        "quant_head_first": bool(t and q.get("head") and q.get("head_first", False)),
    }


def alloc_conf(config: Mapping[str, Any]) -> str:
    """PYTORCH_CUDA_ALLOC_CONF as the ranks got it (trim.env; a script's `context` fix sets it there too)."""
    return str(((config.get("trim") or {}).get("env") or {}).get("PYTORCH_CUDA_ALLOC_CONF") or "")


def _policy_used(config: Mapping[str, Any], facts: Facts) -> Optional[Dict[str, List[str]]]:
    """The injection policy the engine reported it used, else what the config resolves to."""
    if facts.policy_used is not NOT_REPORTED:
        return facts.policy_used or None
    eng, model = (config.get(k) or {} for k in ("engine", "model"))
    return effective_policy(
        eng.get("injection_policy", "auto"), bool(eng.get("kernel_inject")), model.get("injection_policy")
    )


def second_communicator(s: Strategy) -> bool:
    """Whether the engine makes its own tensor-parallel group beside the world's (a second NCCL communicator):
    DeepSpeed's init_inference does, unless trim.world_group hands it the world group."""
    from dsexp.engines import init_inference
    from dsexp.trims import world_group

    return s.engine == init_inference.TRAITS.name and not s.trimmed(world_group.TRAITS.key)


def rank_model(model, s: Strategy, placements: List[Placement], rank: int, tp: int):
    """(a copy of the meta model as rank `rank` holds it, to trace its generate, or None; why not): at tp > 1 where
    the engine's rank code is modelled (AutoTP: `placement.rank_model`, the trims' splits among its placements; at
    tp=1 the linears DeepSpeed wraps under a policy), with trim.last_logits's hook on the head. Kernel injection runs
    DeepSpeed's own kernels: not traced."""
    import copy

    from dsexp.quant import on_meta as quant_meta
    from dsexp.trims import last_logits

    rule = getattr(part(s.engine, "placement"), "rank_model", None) if s.engine in ENGINES else None
    why = quant_meta.not_traced(s)
    if why:
        return None, f"{why}; the allocated bytes' answer stands, with the dequantized weight and KV layer as terms"
    if s.kernel_inject or (tp > 1 and rule is None):
        return None, f"engine {s.engine}{' with kernel injection' if s.kernel_inject else ''}: its ranks are not traced"
    ranked = rule(model, s, placements, rank, tp) if rule else copy.deepcopy(model)
    if s.trimmed(last_logits.TRAITS.key):
        last_logits.keep_last_logits(ranked)
    if s.quant:
        quant_meta.quantize_on_meta(ranked, s)
    return ranked, None


def quantized_order(ranked) -> List[int]:
    """A quantized rank model's allocations on the GPU, in order (dsexp.quant.on_meta.allocation_order)."""
    from dsexp.quant import on_meta as quant_meta

    return quant_meta.allocation_order(ranked)


def init_fails(model, s: Strategy, tp: int) -> Optional[str]:
    """Why the engine's own init refuses this model at tp (the member's `placement.init_fails`: DeepSpeed's AutoTP
    run on the meta device as each rank); None where it gets through or the engine has no such check."""
    rule = getattr(part(s.engine, "placement"), "init_fails", None) if s.engine in ENGINES else None
    return rule(model, s, tp) if rule else None


def script_as_configured(config: Mapping[str, Any]) -> Dict[str, Any]:
    """A user's script before it runs (no rank has recorded a call: a plan or a budget search predicting it): the
    configuration its config alone says: the model group (the checkpoint {model_dir} names), tp, dtype and the engine
    group as configured (init_inference with AutoTP unless told otherwise); each rank loading its part on the meta
    device where script.fix asks meta_load (else a whole copy per rank), dsexp's trims where it asks trims at tp > 1,
    the allocator's settings where it asks context. Once it ran, dsexp.analysis.user_script reads the call it made."""
    from dsexp.core.remedies import CONTEXT_ENV, resolve
    from dsexp.trims import MODEL_TRIMS

    fixes = resolve(list((config.get("script") or {}).get("fix") or []))
    trim: Dict[str, Any] = {k: True for k in MODEL_TRIMS} if "trims" in fixes and int(config.get("tp") or 1) > 1 else {}
    if "context" in fixes:
        trim["env"] = dict(CONTEXT_ENV)
    load = {"name": "meta" if "meta_load" in fixes else "eager", "format": "safetensors"}
    return {**config, "load": load, "trim": trim}


RULES = sys.modules[__name__]  # this module is the rules dsexp.predict.job.predict takes (its Rules protocol)
