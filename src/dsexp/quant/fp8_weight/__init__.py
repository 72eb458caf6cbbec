"""quant=fp8_weight: torchao's fp8 weight-only quantization (Float8WeightOnlyConfig, one scale per row): 1 byte per
element plus a 4-byte scale per row; each forward dequantizes the weight to the run dtype (a weight-sized temporary)
and multiplies in it. Runs on the CPU and any GPU."""

from __future__ import annotations

from dsexp.quant.base import Storage
from dsexp.quant.torchao_rules import torchao_member

TRAITS = torchao_member(
    "fp8_weight",
    call="quantize_(model, Float8WeightOnlyConfig())",
    summary="fp8 weights, products in the run dtype (torchao)",
    storage=Storage(bits=8, scale_bytes=4),
    quality_tol=0.25,
    nearest="int8_weight",
)
