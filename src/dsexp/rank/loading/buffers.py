"""Non-persistent buffers (RoPE `inv_freq`, cos/sin caches): computed by the model's own code, in no checkpoint.

`init_inference(dtype=...)` casts every buffer to the run dtype (`module.bfloat16()`), and a model that
went through the meta device gets `torch.empty` memory for them (`to_empty`, or DeepSpeed's
`Loading.load_buffer`). Either way the values the model's constructor computed are gone. We keep a
reference to those originals at load time and put them back after the engine has wrapped the model.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Optional


def non_persistent_buffers(model) -> Dict[str, Any]:
    """{qualified name: tensor} for every buffer its module registered with persistent=False."""
    out = {}
    for mod_name, mod in model.named_modules():
        for name in mod._non_persistent_buffers_set:
            buf = mod._buffers.get(name)
            if buf is not None:
                out[f"{mod_name}.{name}" if mod_name else name] = buf
    return out


def snapshot(model) -> Dict[str, Any]:
    """The buffers as the model computed them (references: the engine replaces, not mutates, them)."""
    bufs = non_persistent_buffers(model)
    meta = [n for n, b in bufs.items() if b.is_meta]
    if meta:
        raise RuntimeError(
            f"non-persistent buffers are on the meta device before the engine ran, so their values "
            f"are unknown: {', '.join(meta[:8])} (build the model with real buffers)"
        )
    return bufs


def _state(current, original) -> str:
    import torch

    if current.is_meta:
        return "meta"
    if current.dtype != original.dtype:
        return "cast"
    if current.shape != original.shape or not torch.equal(current, original.to(current.device)):
        return "changed"
    return "same"


def restore(module, originals: Dict[str, Any], device: str) -> Dict[str, Any]:
    """Put the original buffers back where the engine changed them (on the buffer's device; meta ones on `device`)."""
    fixed: Dict[str, str] = {}
    gone = []
    for name, orig in originals.items():
        owner_name, _, leaf = name.rpartition(".")
        try:
            owner = module.get_submodule(owner_name)
        except AttributeError:  # the engine replaced the owner (kernel injection)
            gone.append(name)
            continue
        current = owner._buffers.get(leaf)
        if current is None:
            gone.append(name)
            continue
        state = _state(current, orig)
        if state != "same":
            owner._buffers[leaf] = orig.to(device if current.is_meta else current.device)
            fixed[name] = state
    return {
        "restored": fixed,
        "not_found": gone,
        "bytes": sum(b.numel() * b.element_size() for b in originals.values()),
    }


def restoring(ctx, originals: Dict[str, Any], fix: Optional[Callable[[Any], Dict[str, Any]]] = None):
    """A loader's `finalize`: its own fix-up `fix` (what it did, as a dict), then, with load.restore_buffers,
    the buffers put back as `snapshot` saw them before the engine ran (under "buffers")."""

    def finalize(module) -> Dict[str, Any]:
        report = fix(module) if fix else {}
        if ctx.spec.load.restore_buffers:
            report["buffers"] = restore(module, originals, ctx.device)
        return report

    return finalize
