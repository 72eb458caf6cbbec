"""What a rank knows about its job: the validated config, its place in the world, and job-time facts."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict

from dsexp.core.schema import JobConfig


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
        from dsexp.models.presets import torch_dtype

        return torch_dtype(self.spec.dtype)
