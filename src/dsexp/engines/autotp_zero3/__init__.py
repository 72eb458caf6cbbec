"""engine=autotp_zero3: AutoTP together with ZeRO stage 3 through `deepspeed.initialize` (tensor_parallel.autotp_size),
inference only.

rank.py: AutoTPZero3 (zero_inference's set-up plus AutoTP's partition_config from the injection policy).
placement.py: AutoTP's shards of the policy layers' Linears (init_inference's rules), ZeRO-3's partitions elsewhere.
"""

from __future__ import annotations

from dsexp.core.gates import VersionGate
from dsexp.engines.base import EngineTraits

TRAITS = EngineTraits(
    "autotp_zero3",
    splits_weights=True,
    zero3=True,
    even_heads=True,
    casts_buffers=False,
    fills_meta=False,
    summary="AutoTP + ZeRO-3 through deepspeed.initialize (tensor_parallel.autotp_size)",
    gate=VersionGate(
        "deepspeed", "0.19.4", "AutoTP together with ZeRO-3 (tensor_parallel.autotp_size) needs DeepSpeed >= 0.19.4"
    ),
)
