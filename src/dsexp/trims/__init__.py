"""The trims (`trim=` group): what stays replicated on every device, removed. One member per `trim.<key>`, in the
folder dsexp/trims/<key>/ holding its traits and validation (`__init__.py`), what it does on a rank (`rank.py`) and
its rule in the memory model (`placement.py`); dsexp.trims.base says what each part provides.

The registry is built from the folders, in the order of TrimConfig's fields (labels and reports list them so)."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from typing import Any, Dict, List, Optional

from dsexp.core.schema import TrimConfig
from dsexp.trims.base import TrimTraits


def _members() -> Dict[str, TrimTraits]:
    members = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__) if m.ispkg)
    found = {m.TRAITS.key: m.TRAITS for m in members}
    return {f.name: found[f.name] for f in dataclasses.fields(TrimConfig) if f.name in found}


TRIMS: Dict[str, TrimTraits] = _members()
# The model trims (switches on the model), in the order the report lists them.
MODEL_TRIMS = tuple(k for k, t in TRIMS.items() if t.short)


def active(trim: Any) -> List[str]:
    """The model trims switched on in a trim config (a TrimConfig or its dict)."""
    get = trim.get if isinstance(trim, dict) else lambda k, d=None: getattr(trim, k, d)
    return [k for k in MODEL_TRIMS if get(k, False)]


def last_position_logits(trim: Any) -> bool:
    """Whether a trim switched on has the head compute the last position's logits only (the memory model's logits)."""
    return any(TRIMS[k].last_position_logits for k in active(trim))


def label(trim: Optional[Dict[str, Any]]) -> Optional[str]:
    """A short name for a configuration's trims, e.g. "trim(dedupe,head)+env(NCCL_MAX_NCHANNELS=8)"; None: none."""
    from dsexp.trims.env import env_value

    trim = trim or {}
    parts = []
    on = active(trim)
    if on:
        parts.append("trim(" + ",".join(TRIMS[k].short for k in on) + ")")
    env = trim.get("env") or {}
    if env:
        parts.append("env(" + ",".join(f"{k}={env_value(v)}" for k, v in sorted(env.items())) + ")")
    return "+".join(parts) or None
