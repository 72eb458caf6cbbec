"""quant=fp8: torchao's fp8 weights with fp8 activations quantized on the fly (Float8DynamicActivationFloat8Weight-
Config, one scale per row), the matrix product in fp8 (`torch._scaled_mm`): a GPU of compute capability 8.9 or more
(Ada, Hopper). The weights: 1 byte per element plus a 4-byte scale per row; no weight-sized temporary in the forward."""

from __future__ import annotations

from dsexp.quant.base import Storage
from dsexp.quant.torchao_rules import torchao_member

TRAITS = torchao_member(
    "fp8",
    call="quantize_(model, Float8DynamicActivationFloat8WeightConfig(granularity=PerRow()))",
    summary="fp8 weights and dynamic fp8 activations (torchao), fp8 matrix products",
    storage=Storage(bits=8, scale_bytes=4),
    forward="fp8",
    quality_tol=0.25,
    devices=("cuda",),
    min_capability=(8, 9),
    device_why="torchao's fp8 products (torch._scaled_mm) need a GPU of compute capability 8.9 or more; on a CPU "
    "or an older GPU use quant=fp8_weight (the same bytes, products in the run dtype)",
)
