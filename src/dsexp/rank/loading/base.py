"""Loading strategies: turn a checkpoint folder into a model on this rank, knowing nothing of engines."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional

from dsexp.core.context import RankContext


@dataclass
class Loaded:
    model: Any
    checkpoint: Optional[Any] = None  # a DeepSpeed checkpoint description for the engine to fill from
    finalize: Optional[Callable[[Any], Dict[str, Any]]] = None  # fix-ups after the engine (returns what it did)
    info: Dict[str, Any] = field(default_factory=dict)


class Loader(ABC):
    name: str = ""

    @abstractmethod
    def load(self, ctx: RankContext, hf_kwargs: Dict[str, Any]) -> Loaded:
        """Build the model; hf_kwargs are extra from_pretrained arguments an engine asks for."""
