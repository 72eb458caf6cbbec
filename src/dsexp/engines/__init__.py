"""The engines (`engine=` group): what wraps the model. One member per folder, dsexp/engines/<name>/, holding the
engine's traits and validation (`__init__.py`), its rank-side class (`rank.py`) and its rule in the memory model
(`placement.py`); dsexp.engines.base says what each part provides.

The registry is built from the folders: ENGINES, {name: traits} (dsexp.engines.base.FAMILY, filled here), for
validation, the memory model and the matrix;
`part` imports a member's rank.py (on ranks) or placement.py (in the analysis) by the engine's name."""

from __future__ import annotations

import importlib
import pkgutil
from types import ModuleType
from typing import Dict

from dsexp.engines.base import FAMILY, EngineTraits


def _members() -> Dict[str, EngineTraits]:
    members = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__) if m.ispkg)
    return {m.TRAITS.name: m.TRAITS for m in members}


FAMILY.update(_members())
ENGINES: Dict[str, EngineTraits] = FAMILY


def traits(name: str) -> EngineTraits:
    if name not in ENGINES:
        raise KeyError(f"engine={name!r} is not implemented; available: {', '.join(sorted(ENGINES))}")
    return ENGINES[name]


def part(name: str, which: str) -> ModuleType:
    """A member's "rank" or "placement" module (imported only where it runs: on a rank, in the analysis)."""
    return importlib.import_module(f"{__name__}.{traits(name).name}.{which}")
