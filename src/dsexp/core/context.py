"""What a rank knows about its job: the validated config, its place in the world, and job-time facts (here, below
the families, because the engines' and trims' rank code reads it as the worker does)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict

from dsexp.core.schema import TORCH_DTYPE_NAMES, JobConfig


@dataclass
class RankContext:
    spec: JobConfig
    rank: int
    local_rank: int
    world_size: int
    job_dir: Path
    model_dir: Path
    runtime: Dict[str, Any] = field(default_factory=dict)  # facts the job prepared (paths, caches)
    device: str = "cpu"  # "cpu" or "cuda:<local_rank>"

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, TORCH_DTYPE_NAMES[self.spec.dtype])
