"""A torch module's non-persistent buffers, duck-typed (no torch import): what the loaders restore, the faults
corrupt and trim.dedupe_buffers shares."""

from __future__ import annotations

from typing import Any, Iterator, Tuple


def owner_of(module, name: str) -> Tuple[Any, str]:
    """(the submodule holding `name`, the attribute) — (None, attribute) where the engine replaced the owner."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        return module.get_submodule(owner_name), leaf
    except AttributeError:  # e.g. kernel injection replaced the layer
        return None, leaf


def non_persistent_buffers(model, include_meta: bool = False) -> Iterator[Tuple[str, Any, str, Any]]:
    """(qualified name, owner module, attribute, tensor) of every non-persistent buffer of a torch module that holds
    data (not on meta, unless include_meta)."""
    for mod_name, mod in model.named_modules():
        for leaf, buf in mod._buffers.items():
            if buf is not None and leaf in mod._non_persistent_buffers_set and (include_meta or not buf.is_meta):
                yield (f"{mod_name}.{leaf}" if mod_name else leaf), mod, leaf, buf
