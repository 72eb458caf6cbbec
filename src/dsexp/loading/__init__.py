"""Registry of loading strategies (`load=` group)."""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Dict

from dsexp.loading.base import Loaded, Loader

_REGISTRY = {"eager": "dsexp.loading.eager:EagerLoader", "meta": "dsexp.loading.meta:MetaLoader",
             "sharded": "dsexp.loading.sharded:ShardedLoader"}


def get_loader(name: str) -> Loader:
    if name not in _REGISTRY:
        raise KeyError(f"load={name!r} is not implemented; available: {', '.join(sorted(_REGISTRY))}")
    mod, cls = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(mod), cls)()


def prepare_load(spec, runtime: Dict[str, Any], job_dir: Path) -> Dict[str, Any]:
    """Job side, before launch: the strategy's preparation and the dtype conversion its ranks will do."""
    loader = get_loader(spec.load.name)
    return {"conversion": loader.conversion(spec), **loader.prepare(spec, runtime, Path(job_dir))}


__all__ = ["Loaded", "Loader", "get_loader", "prepare_load"]
