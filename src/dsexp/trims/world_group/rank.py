"""trim.world_group on a rank: the tensor-parallel group handed to DeepSpeed's inference engine before
`init_inference` (dsexp.engines.init_inference)."""

from __future__ import annotations

from typing import Any, Dict, Tuple


def preset_group(world: bool, tp: int) -> Tuple[Any, Dict[str, Any]]:
    """Hand DeepSpeed's inference engine its tensor-parallel group before init_inference: the world group
    (world=True, tp == world size: one NCCL communicator fewer) or the group DeepSpeed would create itself."""
    import torch.distributed as tdist
    from deepspeed import comm as dist
    from deepspeed.inference.engine import InferenceEngine

    if InferenceEngine.inference_mp_group is not None:
        return InferenceEngine.inference_mp_group, {"group": "already set"}
    if world:
        if tdist.get_world_size() != tp:
            raise RuntimeError(f"trim.world_group needs tp == world size, got tp={tp}, {tdist.get_world_size()}")
        group, what = tdist.group.WORLD, "world (no communicator of DeepSpeed's own)"
    else:
        group, what = dist.new_group(list(range(tp))), "new_group(range(tp)), as DeepSpeed makes it"
    InferenceEngine.inference_mp_group = group
    return group, {"group": what}
