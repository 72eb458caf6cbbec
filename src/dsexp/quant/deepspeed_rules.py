"""What DeepSpeed's weight-quantization members share in their traits: where they compose."""

from __future__ import annotations

from dsexp.quant.base import QuantTraits, Storage

_ZERO_INIT_ONLY = (
    "DeepSpeed quantizes weights as they are built (weight_quantization.quantized_initialization) only inside "
    "ZeRO-3's zero.Init, which engine=zero_inference and engine=autotp_zero3 run; this engine takes no DeepSpeed "
    "config (and init_inference's AutoTP linears are not the nn.Linear it quantizes: DeepSpeed PR #4750, open)"
)
# autotp_zero3 (AutoTP over ZeRO-3) ran and matched the memory model to the byte (results/cpu/quant_compose)
DS_ENGINES_ONLY = {e: _ZERO_INIT_ONLY for e in ("init_inference", "hf_tp")}


def deepspeed_member(key: str, bits: int, quality_tol: float, group: int = 64) -> QuantTraits:
    """A DeepSpeed weight_quantization member: `bits` per value, asymmetric groups of `group` along a row (a scale and
    a minimum each, in the run dtype), quantized as zero.Init builds the model."""
    block = (f'{{"quantized_initialization": {{"num_bits": {bits}, "group_size": {group}, "group_dim": 1, '
             '"symmetric": False}}')  # fmt: skip
    call = f'ds_config["weight_quantization"] = {block} (engine=zero_inference)'
    return QuantTraits(
        key,
        library="deepspeed",
        call=call,
        summary=f"int{bits} weights in groups of {group}, quantized as ZeRO-3 builds the model (DeepSpeed)",
        storage=Storage(bits=bits, scale_bytes=None, group=group, per_group=2),
        quality_tol=quality_tol,
        refuses=DS_ENGINES_ONLY,
        nearest="int8_weight",
        orders=("stream",),
    )
