"""engine=hf_tp: transformers' own tensor parallelism (`tp_plan="auto"`), no DeepSpeed: the peer baseline to AutoTP.

rank.py: HfTP (the from_pretrained arguments that shard while loading). placement.py: the model's TP plan as
transformers resolves it (DTensor shards, torch.chunk sizes).
"""

from __future__ import annotations

from typing import Optional

from dsexp.core.gates import VersionGate
from dsexp.core.schema import ConfigError
from dsexp.engines.base import EngineTraits

# Ranks sharing a GPU talk over gloo (H200: results/h200/shared/check).
SHARED_GPU_REFUSED = (
    "transformers' tensor parallelism (DTensor) loaded and placed the model, then crashed with SIGSEGV in "
    "generate inside torch's dispatch of a DTensor collective over gloo (H200, torch 2.11)"
)


class HfTPTraits(EngineTraits):
    def rules(self, spec) -> None:
        """transformers' TP shards only what the model's own plan names; without a plan it refuses at load."""
        if spec.tp == 1:
            return
        from dsexp.models.kernel_policy import meta_model_of, tp_plan

        if not tp_plan(meta_model_of(spec.model)):
            raise ConfigError(
                f"engine=hf_tp on model={spec.model.name}: its code defines no tensor-parallel plan (no "
                "base_model_tp_plan in its config, no _tp_plan), so transformers' tensor parallelism cannot shard it "
                "(InternLM2's code as published has none); use engine=init_inference (DeepSpeed AutoTP) or a model "
                "with a plan"
            )

    def shared_gpu_problem(self, spec) -> Optional[str]:
        return SHARED_GPU_REFUSED


TRAITS = HfTPTraits(
    "hf_tp",
    splits_weights=True,
    zero3=False,
    even_heads=True,
    casts_buffers=False,
    fills_meta=False,
    summary="transformers' tensor parallelism (tp_plan='auto'), no DeepSpeed",
    gate=VersionGate(
        "transformers", "4.47", "transformers' tensor parallelism (from_pretrained(tp_plan=...)) first shipped in 4.47"
    ),
)
