"""What DeepSpeed's weight-quantization members share in their traits: where they compose."""

from __future__ import annotations

_ZERO_INIT_ONLY = (
    "DeepSpeed quantizes weights as they are built (weight_quantization.quantized_initialization) only inside "
    "ZeRO-3's zero.Init, which engine=zero_inference runs; with AutoTP it does not compose (AutoTP's LinearLayer and "
    "LinearAllreduce are not the nn.Linear it quantizes: DeepSpeed PR #4750, open)"
)
DS_ENGINES_ONLY = {e: _ZERO_INIT_ONLY for e in ("init_inference", "hf_tp", "autotp_zero3")}
