"""Loading strategies: turn a checkpoint folder into a model on this rank, knowing nothing of engines."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from dsexp.config import JobConfig
from dsexp.context import RankContext


@dataclass
class Loaded:
    model: Any
    checkpoint: Optional[Any] = None              # a DeepSpeed checkpoint description for the engine to fill from
    finalize: Optional[Callable[[Any], Dict[str, Any]]] = None  # fix-ups after the engine (returns what it did)
    info: Dict[str, Any] = field(default_factory=dict)


def dtype_conversion(spec: JobConfig) -> Optional[str]:
    """The checkpoint's dtype to the run's, e.g. "fp32->bf16"; None when they are the same."""
    return None if spec.model.dtype == spec.dtype else f"{spec.model.dtype}->{spec.dtype}"


class Loader(ABC):
    name: str = ""

    def prepare(self, spec: JobConfig, runtime: Dict[str, Any], job_dir: Path) -> Dict[str, Any]:
        """Job-side work before the ranks start (e.g. a cached split); returns runtime facts for the ranks."""
        return {}

    def conversion(self, spec: JobConfig) -> Optional[str]:
        """The dtype conversion the ranks do while loading, e.g. "fp32->bf16" (None: none)."""
        return dtype_conversion(spec)

    @abstractmethod
    def load(self, ctx: RankContext, hf_kwargs: Dict[str, Any]) -> Loaded:
        """Build the model; hf_kwargs are extra from_pretrained arguments an engine asks for."""
