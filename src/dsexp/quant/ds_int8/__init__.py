"""quant=ds_int8: DeepSpeed's own weight quantization as ZeRO-3 builds the model (ds_config `weight_quantization:
quantized_initialization`, int8, asymmetric, groups of 64): every nn.Linear and nn.Embedding weight becomes one flat
tensor of the quantized bytes, a scale and a minimum per group (in the run dtype), partitioned over the ranks like
any ZeRO-3 parameter; each forward gathers and dequantizes the layer (a weight-sized temporary)."""

from __future__ import annotations

from dsexp.quant.deepspeed_rules import deepspeed_member

TRAITS = deepspeed_member("ds_int8", bits=8, quality_tol=0.15)
