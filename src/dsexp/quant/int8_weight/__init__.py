"""quant=int8_weight: torchao's int8 weight-only quantization (Int8WeightOnlyConfig, one fp32 scale and one int8
zero-point per row): 1 byte per element plus 5 bytes per row; each forward casts the weight to the run dtype (a
weight-sized temporary). Runs on the CPU and any GPU."""

from __future__ import annotations

from dsexp.quant.base import Storage
from dsexp.quant.torchao_rules import torchao_member

TRAITS = torchao_member(
    "int8_weight",
    call="quantize_(model, Int8WeightOnlyConfig())",
    summary="int8 weights, products in the run dtype (torchao)",
    storage=Storage(bits=8, scale_bytes=5),
    quality_tol=0.15,
)
