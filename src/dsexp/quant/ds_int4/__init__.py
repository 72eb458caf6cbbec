"""quant=ds_int4: DeepSpeed's int4 weight quantization as ZeRO-3 builds the model (as quant=ds_int8, 4 bits: two
values a byte, groups of 64)."""

from __future__ import annotations

from dsexp.quant.deepspeed_rules import deepspeed_member

TRAITS = deepspeed_member("ds_int4", bits=4, quality_tol=0.5)
