"""trim.world_group: AutoTP all-reduces on the world process group (tp == world size), so DeepSpeed creates no second
NCCL communicator.

DeepSpeed's inference engine creates its own tensor-parallel group (`dist.new_group`) even when tp is the world size,
unless `InferenceEngine.inference_mp_group` is already set: rank.py sets it to the world group. The same attribute
hands DeepSpeed the group built for a VocabParallelEmbedding made before init (trim.shard_embedding). It places no
tensor: the memory model has no rule for it (the communicator is measured outside PyTorch's allocator).
"""

from __future__ import annotations

from dsexp.trims.base import TrimTraits

TRAITS = TrimTraits(
    "world_group",
    short="world",
    summary="init_inference AutoTP: all-reduce on the world group (no second NCCL communicator)",
    autotp_only=True,
)
