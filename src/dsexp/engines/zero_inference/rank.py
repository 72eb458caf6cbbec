"""zero_inference on a rank: `deepspeed.initialize` with ZeRO stage 3, parameters partitioned while they load.

`HfDeepSpeedConfig` is created in `before_load` and kept alive on the engine: while it exists,
transformers' `from_pretrained` builds the model inside `deepspeed.zero.Init`, so each rank only ever
holds its 1/N partition (or none, with `zero.offload=cpu`). Layers are all-gathered as the forward
pass reaches them, so every rank must run the same generate, with `synced_gpus=True`.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

from dsexp.core.config_trace import FieldReadTracer
from dsexp.core.context import RankContext
from dsexp.engines.init_inference.rank import zero_field_names
from dsexp.engines.rank import Engine


def ds_config(ctx: RankContext) -> Dict[str, Any]:
    """The DeepSpeed config dict: the zero group as `zero_optimization`, the run dtype, batch 1 per rank."""
    z = ctx.spec.zero
    zero: Dict[str, Any] = {"stage": z.stage, **z.extra}
    if z.offload == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": ctx.on_gpu}
    cfg: Dict[str, Any] = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": zero, "steps_per_print": 2**31 - 1}
    if ctx.spec.dtype == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif ctx.spec.dtype == "fp16":
        cfg["fp16"] = {"enabled": True}
    return cfg


class ZeroInference(Engine):
    name = "zero_inference"
    # entries a quant member adds to the DeepSpeed config (its weight_quantization block: dsexp.quant.rank)
    config_extra: Dict[str, Any] = {}

    def config(self, ctx: RankContext) -> Dict[str, Any]:
        return {**ds_config(ctx), **self.config_extra}

    def before_load(self, ctx: RankContext) -> None:
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
        from transformers.integrations import HfDeepSpeedConfig

        self.ds_config = self.config(ctx)
        # (config class, prefix in the report, fields the user set): checked for readers after generate.
        self.traced = [(DeepSpeedZeroConfig, "zero", zero_field_names(ctx)), *self.traced_configs()]
        # Started before loading: zero.Init reads the ZeRO block while from_pretrained builds the model.
        self.tracer = FieldReadTracer([cls for cls, _, _ in self.traced]).start()
        self.hf_ds_config = HfDeepSpeedConfig(self.load_config())  # must stay referenced until the run ends

    def load_config(self) -> Dict[str, Any]:
        """What from_pretrained sees: the config as is (ZeRO-3 makes it build the model under zero.Init)."""
        return self.ds_config

    def traced_configs(self) -> List[Tuple[type, str, List[str]]]:
        return []

    def apply(self, model, ctx: RankContext, checkpoint: Optional[Any] = None) -> Tuple[Any, Dict[str, Any]]:
        import deepspeed

        partitioned_at_load = all(hasattr(p, "ds_id") for p in model.parameters())
        engine, *_ = deepspeed.initialize(model=model, config=self.ds_config)
        self.ds_engine = engine  # keeps the ZeRO hooks' owner alive through generate
        return engine.module.eval(), {"call": {"ds_config": self.ds_config}, "partitioned_at_load": partitioned_at_load}

    def generate_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        return {"synced_gpus": ctx.world_size > 1}

    def finish(self, report: Dict[str, Any]) -> Dict[str, Any]:
        tracer = getattr(self, "tracer", None)
        if tracer is None:
            return report
        tracer.stop()
        fields = [(cls.__name__, f"{prefix}.{f}", f) for cls, prefix, names in self.traced for f in names]
        report["unread_fields"] = [key for cls, key, f in fields if not tracer.used(cls, f)]
        report["field_readers"] = {key: tracer.readers(cls, f) for cls, key, f in fields}
        return report


ENGINE = ZeroInference
