"""Registry of loading strategies (`load=` group)."""
from __future__ import annotations

import importlib

from dsexp.loading.base import Loaded, Loader

_REGISTRY = {"eager": "dsexp.loading.eager:EagerLoader"}


def get_loader(name: str) -> Loader:
    if name not in _REGISTRY:
        raise KeyError(f"load={name!r} is not implemented; available: {', '.join(sorted(_REGISTRY))}")
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)()


__all__ = ["Loaded", "Loader", "get_loader"]
