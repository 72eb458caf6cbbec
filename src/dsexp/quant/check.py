"""A job's quant settings held to the members' rules before anything is launched: the member and its order, the
device and its compute capability, the engine (and kernel injection), the KV cache, the dtype. Each problem names
the key, the reason and what would work."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from dsexp.quant import NONE, QUANTS, traits
from dsexp.quant import kv as kv_member
from dsexp.quant.base import AFTER, EMPTY_CACHE, STREAM

ORDERS = ("auto", STREAM, AFTER)
# what a user who asked DeepSpeed for int8 (init_inference(dtype=torch.int8), dtype=int8) gets told to use instead
QUANT_INSTEAD = (
    "quant=int8_weight (torchao int8 weights; tp=1, or engine=hf_tp), quant=fp8_weight (fp8 weights, AutoTP at any "
    "tp), quant=fp8 (fp8 weights and products, GPU of compute capability >= 8.9) or quant=ds_int8 (DeepSpeed's own, "
    "engine=zero_inference zero=stage3)"
)
DEAD_INT8_PATH = (
    "its int8 path is gone: supported_dtypes() are fp32, fp16 and bf16, init_inference's int8 branch is disabled and "
    "kernel injection's weight quantization is commented out (DeepSpeed issue #2956)"
)
DEAD_INT8 = f"DeepSpeed's kernel injection runs its own fused kernels in the run dtype, and {DEAD_INT8_PATH}"


def problems(
    spec: Any,
    device: str,
    capability: Optional[Tuple[int, int]],
    autotp: bool,
    model_dims: Dict[str, Any],
) -> List[str]:
    """Every reason the job's quant settings cannot run (empty: they can). `autotp`: the engine shards the linears
    with AutoTP's modules in this job (init_inference at tp > 1, or under a policy)."""
    q = spec.quant
    out: List[str] = []
    if q.name != NONE and q.name not in QUANTS:
        return [f"quant={q.name!r} is not a member; choose one of: none, {', '.join(QUANTS)}"]
    if q.order not in ORDERS:
        out.append(f"quant.order={q.order!r}: choose one of {', '.join(ORDERS)}")
    if q.empty_cache not in EMPTY_CACHE:
        out.append(f"quant.empty_cache={q.empty_cache!r}: choose one of {', '.join(EMPTY_CACHE)}")
    t = traits(q.name)
    if t is not None:
        out += _member_problems(spec, t, device, capability, autotp)
    head = head_problem(spec, t)
    if head:
        out.append(head)
    kv = kv_member.problem(q, model_dims, spec.engine.kernel_inject)
    if kv:
        out.append(kv)
    return out


def _member_problems(spec, t, device, capability, autotp) -> List[str]:
    q, out = spec.quant, []
    if q.order not in ("auto", *t.orders):
        out.append(f"quant.order={q.order} with quant={t.key}: it runs in {' or '.join(t.orders)} order only")
    why = t.device_problem(device, capability)
    if why:
        out.append(why)
    if spec.engine.kernel_inject:
        out.append(f"quant={t.key} with engine.kernel_inject=true: {DEAD_INT8}; set engine.kernel_inject=false")
    if t.library == "torchao" and spec.engine.name == "hf_tp" and q.order == AFTER and q.check_composition:
        out.append(
            f"quant.order=after with quant={t.key} and engine=hf_tp: torchao's quantize_ after transformers sharded "
            "the weights leaves plain tensors beside its DTensors (aten.mm.default got mixed torch.Tensor and DTensor, "
            "results/cpu/quant_compose); leave quant.order=auto: transformers quantizes each weight as it loads it"
        )
    why = t.engine_problem(spec.engine.name, autotp) if q.check_composition else None
    if why:
        out.append(f"{why}; the nearest that composes: {nearest(t, spec.engine.name, autotp, device)}")
    if t.storage.bits == 4 and t.library == "torchao" and spec.dtype != "bf16":
        out.append(f"quant={t.key} with dtype={spec.dtype}: torchao's int4 packing takes bf16 weights; set dtype=bf16")
    if q.group_size is not None and q.group_size <= 0:
        out.append(f"quant.group_size={q.group_size}: must be > 0 (null: the member's own)")
    elif q.group_size is not None and not t.storage.group:
        grouped = ", ".join(k for k, m in QUANTS.items() if m.storage.group)
        out.append(
            f"quant.group_size={q.group_size} with quant={t.key}: it stores one scale per row ({t.call}), so a group "
            f"size would change nothing it runs; the members with scale groups: {grouped}"
        )
    return out


def head_problem(spec, t) -> Optional[str]:
    """quant.head=true where it means nothing or cannot apply."""
    if not spec.quant.head:
        return None
    if t is None:
        return "quant.head=true with quant=none: it quantizes the output head with a torchao member (quant=int4_weight)"
    if t.library != "torchao":
        return (
            f"quant.head=true with quant={t.key}: DeepSpeed's members quantize every linear and embedding weight, the "
            "head included, as zero.Init builds them; drop quant.head"
        )
    if spec.engine.name == "hf_tp":
        return (
            "quant.head=true with engine=hf_tp: there transformers quantizes as it loads (TorchAoConfig), whose "
            "default leaves the head in the run dtype, and dsexp sets no other; use engine=init_inference"
        )
    return None


def nearest(t, engine: str, autotp: bool, device: str) -> str:
    """The members that compose with this engine on this device, the member's own suggestion first."""
    ok = [
        k for k, m in QUANTS.items() if m.engine_problem(engine, autotp) is None and device in m.devices and k != t.key
    ]
    ok.sort(key=lambda k: k != t.nearest)
    if ok:
        return "quant=" + " or quant=".join(ok[:2]) + f" (engine={engine})"
    return f"none under engine={engine}; see docs/configuration.md#quantization"
