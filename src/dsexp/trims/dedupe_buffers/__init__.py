"""trim.dedupe_buffers: identical non-persistent buffers (InternLM2 keeps per-layer rotary cos/sin tables computed
from one config) share one tensor on each device; under every engine.

Moving or casting a module converts each owner's buffer separately, so sharing only holds once the engine has placed
the model; to keep the copies off the device while it does, the duplicates found before the engine are taken out of
their modules and put back after it as the placed tensor of the first of their group (rank.py). placement.py: the
shared buffers take no bytes of their own. Here: the rule that finds them, which both use.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Iterable, List, Tuple

from dsexp.core.module_buffers import non_persistent_buffers
from dsexp.trims.base import TrimTraits

TRAITS = TrimTraits(
    "dedupe_buffers",
    short="dedupe",
    summary="identical non-persistent buffers (per-layer rotary tables) share one tensor per device",
)


def identical(items: Iterable[Tuple[str, Hashable, Any]], equal: Callable[[Any, Any], bool]) -> Dict[str, str]:
    """{name: the first earlier name with the same key and an equal value} over (name, key, value) items.

    The rule dedupe_buffers shares by: the key holds what must match exactly (the buffer's attribute name, dtype,
    shape, strides, device), `equal` compares values (torch.equal). Names that are the first of their values are
    not in the result."""
    firsts: Dict[Hashable, List[Tuple[str, Any]]] = {}
    out: Dict[str, str] = {}
    for name, key, value in items:
        seen = firsts.setdefault(key, [])
        match = next((n for n, v in seen if equal(v, value)), None)
        if match is None:
            seen.append((name, value))
        else:
            out[name] = match
    return out


def duplicate_buffers(model, equal: Callable[[Any, Any], bool]) -> Dict[str, str]:
    """{buffer name: the first buffer with the same attribute name, dtype, shape, strides, device and values
    (`equal`, e.g. torch.equal)} over the model's non-persistent buffers: what trim.dedupe_buffers shares."""
    items = (
        (name, (leaf, str(buf.dtype), tuple(buf.shape), tuple(buf.stride()), str(buf.device)), buf)
        for name, _, leaf, buf in non_persistent_buffers(model)
    )
    return identical(items, lambda a, b: a is b or equal(a, b))
