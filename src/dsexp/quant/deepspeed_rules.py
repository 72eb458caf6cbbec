"""What DeepSpeed's weight-quantization members share in their traits: where they compose."""

from __future__ import annotations

_ZERO_INIT_ONLY = (
    "DeepSpeed quantizes weights as they are built (weight_quantization.quantized_initialization) only inside "
    "ZeRO-3's zero.Init, which engine=zero_inference and engine=autotp_zero3 run; this engine takes no DeepSpeed "
    "config (and init_inference's AutoTP linears are not the nn.Linear it quantizes: DeepSpeed PR #4750, open)"
)
# autotp_zero3 (AutoTP over ZeRO-3) ran and matched the memory model to the byte (results/cpu/quant_compose)
DS_ENGINES_ONLY = {e: _ZERO_INIT_ONLY for e in ("init_inference", "hf_tp")}
