"""quant=int4_weight: torchao's int4 weight-only quantization, groups of 128 along a row, packed for the tinygemm
kernel (Int4WeightOnlyConfig(int4_packing_format="tile_packed_to_4d")): half a byte per element plus a bf16 scale
and zero-point per group, rows padded to 8 and columns to 1024. A GPU of compute capability 8.0 or more; bf16 only."""

from __future__ import annotations

from dsexp.quant.base import Storage
from dsexp.quant.torchao_rules import torchao_member

TRAITS = torchao_member(
    "int4_weight",
    call='quantize_(model, Int4WeightOnlyConfig(group_size=128, int4_packing_format="tile_packed_to_4d"))',
    summary="int4 weights in groups of 128, tinygemm's packing (torchao)",
    storage=Storage(bits=4, scale_bytes=4, group=128, pad_out=8, pad_in=1024),
    forward="packed",
    quality_tol=0.5,
    devices=("cuda",),
    min_capability=(8, 0),
    device_why="torchao's int4 packing for the CPU needs the mslk package (not on PyPI) and its tinygemm packing a "
    "GPU of compute capability 8.0 or more; on the CPU use quant=int8_weight or quant=ds_int4 (engine=zero_inference)",
    max_output_elements=2**31,
    max_output_why="tinygemm's int4 kernel (aten._weight_int4pack_mm) indexes a product's output in 32 bits: on the "
    "H100 one 16384-wide linear ran 131072 tokens (2^31 output elements) and faulted at 139264 with a CUDA illegal "
    "memory access, as a forward of 72 x 2048 tokens did (results/h200/quant: int4_limit.json, budget60)",
)
