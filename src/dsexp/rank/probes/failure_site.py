"""Which module of the model an exception came from, read from its traceback (nothing runs during the phase).

The frames of a traceback keep their locals. The outermost frame whose `self` is an nn.Module (the model's
`generate`, DeepSpeed's InferenceEngine) gives the module tree; the innermost frame holding a module of that tree
(its `self`, or a module it was handed, as DeepSpeed's replacement code is) names where it failed:
e.g. `model.layers.0.self_attn.o_proj` (a LinearAllreduce inside Phi3Attention) for a shape mismatch.
"""

from __future__ import annotations

import sys
from typing import Any, Dict, Optional


def failure_site(error: BaseException) -> Optional[Dict[str, Any]]:
    """{"module": qualified name, "class": its class, "parent_class": its parent's class, "code": file:line in
    function of the innermost frame inside it, "innermost_class": the innermost nn.Module running} or None."""
    nn = sys.modules.get("torch.nn")
    if nn is None or error.__traceback__ is None:
        return None
    try:
        return _site(error, nn.Module)
    except Exception:  # never let the diagnosis of a failure fail the record of it
        return None


def _site(error: BaseException, Module) -> Optional[Dict[str, Any]]:
    frames = []
    tb = error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    root = next((f.f_locals["self"] for f, _ in frames if isinstance(f.f_locals.get("self"), Module)), None)
    if root is None:
        return None
    inner = getattr(root, "module", None)  # DeepSpeed's engines wrap the model as .module
    if isinstance(inner, Module):
        root = inner
    names = {id(m): n for n, m in root.named_modules()}
    parents = {
        id(child): parent for parent in root.modules() for child in parent.children()
    }  # to name the block a module sits in
    innermost = next(
        (type(f.f_locals["self"]).__name__ for f, _ in reversed(frames) if isinstance(f.f_locals.get("self"), Module)),
        None,
    )
    for frame, line in reversed(frames):
        local = frame.f_locals
        candidates = [local.get("self")] + [v for k, v in local.items() if k != "self"]
        module = next((m for m in candidates if isinstance(m, Module) and id(m) in names and names[id(m)]), None)
        if module is None:
            continue
        parent = parents.get(id(module))
        code = frame.f_code
        return {
            "module": names[id(module)],
            "class": type(module).__name__,
            "parent_class": type(parent).__name__ if parent is not None else None,
            "code": f"{code.co_filename.rsplit('/', 1)[-1]}:{line} in {code.co_name}",
            "innermost_class": innermost,
        }
    return None
