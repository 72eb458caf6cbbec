"""quant=ds_int8: DeepSpeed's own weight quantization as ZeRO-3 builds the model (ds_config `weight_quantization:
quantized_initialization`, int8, asymmetric, groups of 64): every nn.Linear and nn.Embedding weight becomes one flat
tensor of the quantized bytes, a scale and a minimum per group (in the run dtype), partitioned over the ranks like
any ZeRO-3 parameter; each forward gathers and dequantizes the layer (a weight-sized temporary)."""

from __future__ import annotations

from dsexp.quant.base import QuantTraits, Storage
from dsexp.quant.deepspeed_rules import DS_ENGINES_ONLY

TRAITS = QuantTraits(
    "ds_int8",
    library="deepspeed",
    call='ds_config["weight_quantization"] = {"quantized_initialization": {"num_bits": 8, "group_size": 64, '
    '"group_dim": 1, "symmetric": False}} (engine=zero_inference)',
    summary="int8 weights in groups of 64, quantized as ZeRO-3 builds the model (DeepSpeed)",
    storage=Storage(bits=8, scale_bytes=None, group=64, per_group=2),
    quality_tol=0.15,
    refuses=DS_ENGINES_ONLY,
    nearest="int8_weight",
    orders=("stream",),
)
