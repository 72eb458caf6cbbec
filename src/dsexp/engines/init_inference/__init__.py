"""engine=init_inference: `deepspeed.init_inference`, kernel injection or AutoTP with an injection policy.

rank.py: InitInference (the call, what DeepSpeed read of it, the AutoTP trims around it). placement.py: AutoTP's
split rules (DeepSpeed's own shard sizes, fused qkv, the head) and kernel injection's.
"""

from __future__ import annotations

from typing import List, Optional

from dsexp.engines.base import EngineTraits

SHARED_KERNEL_INJECTION = (
    "DeepSpeed's inference kernels (kernel injection with a DeepSpeed policy for {layers}) have not been run with "
    "ranks sharing a GPU (their JIT build outlasted the measurement); AutoTP (engine.kernel_inject=false) runs shared"
)


def kernel_injected_layers(spec) -> List[str]:
    """Layer classes of the job's model that DeepSpeed has a kernel policy for (none: kernel injection is a no-op,
    runnable on CPU)."""
    from dsexp.models.kernel_policy import kernel_injected_layers as layers
    from dsexp.models.kernel_policy import meta_model_of

    return layers(meta_model_of(spec.model))


class InitInferenceTraits(EngineTraits):
    def device_problem(self, spec, device: str) -> Optional[str]:
        if device != "cpu" or not spec.engine.kernel_inject:
            return None
        layers = kernel_injected_layers(spec)
        if not layers:
            return None
        return (
            f"engine.kernel_inject=true on device=cpu: DeepSpeed's kernel injection would replace "
            f"{', '.join(layers)} of model={spec.model.name} with CUDA kernels; "
            "set engine.kernel_inject=false or run on a GPU machine"
        )

    def shared_gpu_problem(self, spec) -> Optional[str]:
        if not spec.engine.kernel_inject:
            return None
        layers = kernel_injected_layers(spec)  # none (InternLM2, the seed's case): injection is a no-op, it runs
        return SHARED_KERNEL_INJECTION.format(layers=", ".join(layers)) if layers else None


TRAITS = InitInferenceTraits(
    "init_inference",
    splits_weights=True,
    zero3=False,
    even_heads=False,
    casts_buffers=True,
    fills_meta=True,
    inference_autotp=True,
    summary="deepspeed.init_inference: kernel injection, or AutoTP with an injection policy",
)
