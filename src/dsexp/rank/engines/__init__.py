"""Engines (`engine=` group): what wraps the model. Their names and traits live in `dsexp.core.engines`."""

from __future__ import annotations

import importlib

from dsexp.core.engines import traits
from dsexp.rank.engines.base import Engine


def get_engine(name: str) -> Engine:
    mod, cls = traits(name).impl.split(":")
    return getattr(importlib.import_module(mod), cls)()


__all__ = ["Engine", "get_engine"]
