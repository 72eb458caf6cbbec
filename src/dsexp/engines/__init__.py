"""Registry of engines (`engine=` group)."""
from __future__ import annotations

import importlib

from dsexp.engines.base import Engine

_REGISTRY = {
    "init_inference": "dsexp.engines.init_inference:InitInference",
    "zero_inference": "dsexp.engines.zero_inference:ZeroInference",
    "autotp_zero3": "dsexp.engines.autotp_zero3:AutoTPZero3",
    "hf_tp": "dsexp.engines.hf_tp:HfTP",
}


def get_engine(name: str) -> Engine:
    if name not in _REGISTRY:
        raise KeyError(f"engine={name!r} is not implemented; available: {', '.join(sorted(_REGISTRY))}")
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)()


__all__ = ["Engine", "get_engine"]
