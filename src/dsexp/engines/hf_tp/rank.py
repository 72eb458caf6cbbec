"""hf_tp on a rank: transformers' own tensor parallelism (`tp_plan="auto"`), the peer baseline to DeepSpeed's AutoTP.

`from_pretrained(distributed_config=DistributedConfig(tp_plan="auto"))` shards the checkpoint as it
loads, following the config's `base_model_tp_plan` and the model's `_tp_plan` (DTensor parameters);
the standalone `tp_plan="auto"` argument is the fallback for versions without DistributedConfig.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from dsexp.core.context import RankContext
from dsexp.engines.rank import Engine


def tp_load_kwargs(world_size: int) -> Dict[str, Any]:
    try:
        from transformers import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto", "tp_size": world_size}
    return {"distributed_config": DistributedConfig(tp_plan="auto", tp_size=world_size)}


class HfTP(Engine):
    name = "hf_tp"

    def load_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        return tp_load_kwargs(ctx.world_size)

    def apply(self, model, ctx: RankContext, checkpoint: Optional[Any] = None) -> Tuple[Any, Dict[str, Any]]:
        plan = getattr(model, "tp_plan", None) or getattr(model, "_tp_plan", None)
        call = {k: getattr(v, "to_dict", lambda: v)() for k, v in self.load_kwargs(ctx).items()}
        return model.eval(), {"call": call, "tp_plan": dict(plan) if plan else None}


ENGINE = HfTP
