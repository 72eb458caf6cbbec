"""Quantization (`quant=` group): quantized weights (one member per `quant=<key>`, in dsexp/quant/<key>/) and a
quantized KV cache (`quant.kv`, dsexp/quant/kv/). dsexp.quant.base says what a member provides.

QUANTS, {key: traits}, is built from the folders; `check` holds a job's quant settings to the members' rules (device,
compute capability, engine, kernel injection, the KV cache's backend) and raises ConfigError naming the key, the
reason and what would work."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, Dict, Optional, Tuple

from dsexp.quant.base import AFTER, EACH, STREAM, QuantTraits

NONE = "none"


def _members() -> Dict[str, QuantTraits]:
    found = (importlib.import_module(f"{__name__}.{m.name}") for m in pkgutil.iter_modules(__path__) if m.ispkg)
    return {m.TRAITS.key: m.TRAITS for m in found if isinstance(getattr(m, "TRAITS", None), QuantTraits)}


QUANTS: Dict[str, QuantTraits] = dict(sorted(_members().items()))


def traits(name: str) -> Optional[QuantTraits]:
    """The weight member's traits; None for quant=none."""
    if name == NONE:
        return None
    if name not in QUANTS:
        raise KeyError(f"quant={name!r} is not a member; choose one of: none, {', '.join(QUANTS)}")
    return QUANTS[name]


def _get(q: Any, key: str, default: Any = None) -> Any:
    return q.get(key, default) if isinstance(q, dict) else getattr(q, key, default)


def label(quant: Any) -> Optional[str]:
    """A configuration's quantization in its short name: "q(fp8_weight,kv4)"; None without any."""
    if not quant:
        return None
    parts = [p for p in (_get(quant, "name", NONE), kv_label(quant)) if p and p != NONE]
    order = _get(quant, "order", "auto")
    if parts and order not in (None, "auto"):
        parts.append(order)
    if parts and _get(quant, "head", False):
        parts.append("head")
    if parts and _get(quant, "empty_cache", EACH) not in (None, EACH):
        parts.append(f"empty-{_get(quant, 'empty_cache')}")
    return f"q({','.join(parts)})" if parts else None


def kv_label(quant: Any) -> Optional[str]:
    bits = _get(quant, "kv")
    if bits is None:
        return None
    backend = _get(quant, "kv_backend", "quanto")
    return f"kv{bits}" + ("" if backend == "quanto" else f"-{backend}")


def order_of(quant: Any) -> str:
    """The order a job quantizes in: quant.order, or the member's own where it is auto."""
    t = traits(_get(quant, "name", NONE))
    order = _get(quant, "order", "auto")
    if t is None:
        return order if order != "auto" else STREAM
    return t.orders[0] if order == "auto" else order


def group_size(quant: Any) -> Optional[int]:
    t = traits(_get(quant, "name", NONE))
    return _get(quant, "group_size") or (t.storage.group if t else None) or None


def tolerance(quant: Any, base: float) -> Tuple[float, Optional[str]]:
    """The logits' relative error a run may show: quant.quality_tol, else the member's own (plus the KV cache's),
    never below the run dtype's `base`; and why, in words (None: not quantized, the dtype's)."""
    explicit = _get(quant, "quality_tol")
    if explicit is not None:
        return float(explicit), "quant.quality_tol"
    t = traits(_get(quant, "name", NONE))
    kv = _get(quant, "kv")
    if t is None and kv is None:
        return base, None
    # a quantized cache leaves the first step's logits as they were (the prefill attends to the keys unquantized):
    # what it costs shows in the greedy tokens' agreement
    return max(base, t.quality_tol if t else base), f"quant={label(quant)}'s own"


__all__ = ["AFTER", "NONE", "QUANTS", "STREAM", "QuantTraits", "group_size", "label", "order_of", "tolerance", "traits"]
