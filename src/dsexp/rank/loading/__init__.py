"""Loading strategies (`load=` group): how each rank gets its weights, knowing nothing of engines."""

from __future__ import annotations

import importlib

from dsexp.rank.loading.base import Loaded, Loader

REGISTRY = {
    "eager": "dsexp.rank.loading.eager:EagerLoader",
    "meta": "dsexp.rank.loading.meta:MetaLoader",
    "sharded": "dsexp.rank.loading.sharded:ShardedLoader",
}


def get_loader(name: str) -> Loader:
    if name not in REGISTRY:
        raise KeyError(f"load={name!r} is not implemented; available: {', '.join(sorted(REGISTRY))}")
    mod, cls = REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)()


__all__ = ["Loaded", "Loader", "get_loader"]
