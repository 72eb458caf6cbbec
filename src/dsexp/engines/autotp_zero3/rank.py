"""autotp_zero3 on a rank: AutoTP together with ZeRO stage 3 through `deepspeed.initialize` (inference only: no
optimizer).

DeepSpeed >= 0.19.4 shards the model with AutoTP when the config has `tensor_parallel.autotp_size`,
then partitions the shards with ZeRO-3 over the data-parallel group (world / autotp_size ranks).
The model is built under zero.Init as in `zero_inference` (ZeRO-3 over all ranks: transformers refuses
`autotp_size` at load); in `initialize` AutoTP gathers each weight it shards and keeps its slice.
Which layers are row- or column-parallel comes from the model preset's injection policy, given to
DeepSpeed as a `partition_config`; without a policy DeepSpeed uses the model's HF tp_plan or its parser.
"""

from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Tuple

from dsexp.core.context import RankContext
from dsexp.engines.init_inference.rank import applied_policy
from dsexp.engines.zero_inference.rank import ZeroInference
from dsexp.models.policy import ds_name


def partition_config(model, policy: Dict[str, List[str]]) -> Dict[str, Any]:
    """The policy's linears row-parallel, every other Linear of those layer classes column-parallel."""
    import torch

    rows, cols = set(), set()
    for layer in model.modules():
        row_names = policy.get(type(layer).__name__)
        if row_names is None:
            continue
        for name, child in layer.named_modules():
            if name and isinstance(child, torch.nn.Linear):
                # a policy names a linear as DeepSpeed does ('<parent>.<attr>', '.fc2'), or by its path in the layer
                (rows if name in row_names or ds_name(name) in row_names else cols).add(name)
    if not rows:
        raise ValueError(f"injection policy {policy} names no Linear layer of the model")

    def patterns(names):
        return [rf".*\.{re.escape(n)}\.weight$" for n in sorted(names)]

    specs = [{"patterns": patterns(rows), "partition_type": "row"}]
    if cols:
        specs.append({"patterns": patterns(cols), "partition_type": "column"})
    return {"use_default_specs": False, "layer_specs": specs}


class AutoTPZero3(ZeroInference):
    name = "autotp_zero3"

    def config(self, ctx: RankContext) -> Dict[str, Any]:
        cfg = super().config(ctx)
        cfg["tensor_parallel"] = {"autotp_size": ctx.world_size}
        return cfg

    def load_config(self) -> Dict[str, Any]:
        # transformers (5.2x) refuses to load under zero.Init when the config asks for autotp_size > 1
        # ("Weight conversions ... with DeepSpeed Tensor Parallelism are not yet implemented"), so loading
        # partitions over all ranks by ZeRO-3 alone and AutoTP re-shards in deepspeed.initialize.
        return {k: v for k, v in self.ds_config.items() if k != "tensor_parallel"}

    def traced_configs(self):
        from deepspeed.runtime.tensor_parallel.config import TPTrainingConfig

        return [(TPTrainingConfig, "tensor_parallel", ["autotp_size", "partition_config"])]

    def apply(self, model, ctx: RankContext, checkpoint: Optional[Any] = None) -> Tuple[Any, Dict[str, Any]]:
        policy, inference = applied_policy(ctx, model)
        if policy:  # needs the model's layer classes, so it joins the config only now
            self.ds_config["tensor_parallel"]["partition_config"] = partition_config(model, policy)
        module, report = super().apply(model, ctx, checkpoint)
        report["injection_policy"] = policy
        if inference is not None:
            report["policy_inference"] = inference
        return module, report


ENGINE = AutoTPZero3
