"""engine=zero_inference: ZeRO-Inference, `deepspeed.initialize` with ZeRO stage 3, parameters partitioned while they
load.

rank.py: ZeroInference (HfDeepSpeedConfig before loading, the ZeRO config, what DeepSpeed read of it). placement.py:
ZeRO-3's partitions (1/tp of each parameter, padded; buffers whole; offload=cpu on the host).
"""

from __future__ import annotations

from dsexp.engines.base import EngineTraits

TRAITS = EngineTraits(
    "zero_inference",
    splits_weights=False,
    zero3=True,
    even_heads=False,
    casts_buffers=False,
    fills_meta=False,
    summary="deepspeed.initialize with ZeRO stage 3, partitioned while loading",
)
