"""quant=ds_int4: DeepSpeed's int4 weight quantization as ZeRO-3 builds the model (as quant=ds_int8, 4 bits: two
values a byte, groups of 64)."""

from __future__ import annotations

from dsexp.quant.base import QuantTraits, Storage
from dsexp.quant.deepspeed_rules import DS_ENGINES_ONLY

TRAITS = QuantTraits(
    "ds_int4",
    library="deepspeed",
    call='ds_config["weight_quantization"] = {"quantized_initialization": {"num_bits": 4, "group_size": 64, '
    '"group_dim": 1, "symmetric": False}} (engine=zero_inference)',
    summary="int4 weights in groups of 64, quantized as ZeRO-3 builds the model (DeepSpeed)",
    storage=Storage(bits=4, scale_bytes=None, group=64, per_group=2),
    quality_tol=0.5,
    refuses=DS_ENGINES_ONLY,
    nearest="int8_weight",
    orders=("stream",),
)
