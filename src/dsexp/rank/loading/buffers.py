"""Non-persistent buffers (RoPE `inv_freq`, cos/sin tables): computed by the model's own code, in no checkpoint.

Three things take their values away, and none asks the model's code:
- transformers >= 5 builds a model on the meta device, buffers included, and gives non-persistent buffers
  `torch.empty_like` memory (modeling_utils `_move_missing_keys_from_meta_to_device`); only its own models get
  them back (through `_init_weights`). Remote code that computes them in `__init__`, as InternLM2's does, loads
  with uninitialised tables: NaN or silently wrong logits.
- `init_inference(dtype=...)` casts every buffer to the run dtype (`module.bfloat16()`).
- a model placed from the meta device gets `torch.empty` memory for them (`to_empty`, DeepSpeed's
  `Loading.load_buffer`).

So after every load dsexp recomputes them from the model's own constructor, relying on no method of the model:
a twin of the model is built with its parameters on meta and its buffers real (`build_on_meta`: `from_config`
under `init_empty_weights(include_buffers=False)`, in the run dtype, as from_pretrained would), every buffer that
differs is put back from the twin and recorded with how it was wrong (`nonfinite`, `cast`, `changed`), and after
the engine has wrapped the model they are put back again wherever the engine changed them.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Dict, List, Optional, Tuple

from dsexp.core.compat import dtype_kwargs
from dsexp.core.module_buffers import non_persistent_buffers as core_non_persistent_buffers
from dsexp.core.module_buffers import owner_of


def build_on_meta(ctx):
    """The model with every parameter on meta and its buffers computed for real by its constructor, in the run
    dtype (trust_remote_code honoured)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    remote = ctx.spec.model.trust_remote_code
    cfg = AutoConfig.from_pretrained(str(ctx.model_dir), trust_remote_code=remote)
    with outside_zero3(), init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(cfg, trust_remote_code=remote, **dtype_kwargs(ctx.torch_dtype))
    # init_empty_weights re-registers every parameter on meta, which unties a tied head from the embedding
    # (transformers 4.42 and 5.x): tie them again, as from_pretrained does, so the head is filled with it
    model.tie_weights()
    return model.eval()


@contextlib.contextmanager
def outside_zero3():
    """While a ZeRO-3 engine's HfDeepSpeedConfig is alive, transformers builds every model inside
    deepspeed.zero.Init (partitioned, not on meta): step out of it for a skeleton, through the setter and unsetter
    transformers provides for that config (transformers.integrations.deepspeed, 4.42 to 5.x)."""
    from transformers.integrations import deepspeed as hf_ds

    ref = getattr(hf_ds, "_hf_deepspeed_config_weak_ref", None)
    live = ref() if ref is not None else None
    if live is None:
        yield
        return
    hf_ds.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_ds.set_hf_deepspeed_config(live)


def non_persistent_buffers(model) -> Dict[str, Any]:
    """{qualified name: tensor} for every buffer its module registered with persistent=False (meta ones too)."""
    return {name: buf for name, _, _, buf in core_non_persistent_buffers(model, include_meta=True)}


def snapshot(model) -> Dict[str, Any]:
    """The buffers of a model built by `build_on_meta` (references: the engine replaces, not mutates, them)."""
    bufs = non_persistent_buffers(model)
    meta = [n for n, b in bufs.items() if b.is_meta]
    if meta:
        raise RuntimeError(
            f"non-persistent buffers are on the meta device before the engine ran, so their values "
            f"are unknown: {', '.join(meta[:8])} (build the model with real buffers)"
        )
    return bufs


def nonfinite(tensors: Dict[str, Any], on_host: bool = False) -> List[str]:
    """Names of the floating tensors holding NaN or inf (meta tensors have no values and are skipped); `on_host`:
    each is checked on a host copy (see `host_copy`)."""
    import torch

    def bad(t) -> bool:
        return not torch.isfinite(host_copy(t) if on_host else t).all()

    return [n for n, t in tensors.items() if t.is_floating_point() and not t.is_meta and bad(t)]


def host_copy(t):
    """The tensor on the host. A buffer check made on the GPU leaves its temporaries (isfinite's mask, a copy of the
    expected buffer) in the caching allocator's reserve: on the H200 at 20B shapes, 16-20 MiB reserved and not
    allocated after init, charged to the engine by every NVML figure."""
    return t.detach().cpu()


def _state(current, expected) -> str:
    import torch

    if current.is_meta:
        return "meta"
    current, expected = host_copy(current), host_copy(expected)
    if current.is_floating_point() and not torch.isfinite(current).all():
        return "nonfinite"
    if current.dtype != expected.dtype:
        return "cast"
    if current.shape != expected.shape or not torch.equal(current, expected):
        return "changed"
    return "same"


def differences(module, expected: Dict[str, Any]) -> Tuple[Dict[str, str], List[str]]:
    """({name: how the module's buffer differs from the expected one}, [expected names the module lacks]); the
    module is left as it is."""
    states: Dict[str, str] = {}
    gone = []
    for name, want in expected.items():
        owner, leaf = owner_of(module, name)
        current = owner._buffers.get(leaf) if owner is not None else None
        if current is None:
            gone.append(name)
            continue
        state = _state(current, want)
        if state != "same":
            states[name] = state
    return states, gone


def put_back(module, expected: Dict[str, Any], names, device: str) -> None:
    """Put these expected buffers back (on the buffer's device; meta ones on `device`)."""
    for name in names:
        owner, leaf = owner_of(module, name)
        current = owner._buffers[leaf]
        owner._buffers[leaf] = expected[name].to(device if current.is_meta else current.device)


def restore(module, expected: Dict[str, Any], device: str) -> Dict[str, Any]:
    """Put the expected buffers back where they differ; return {restored: {name: how it was wrong}, not_found:
    [names], bytes}."""
    fixed, gone = differences(module, expected)
    put_back(module, expected, fixed, device)
    return {"restored": fixed, "not_found": gone, "bytes": sum(b.numel() * b.element_size() for b in expected.values())}


def after_load(model, ctx, recompute: bool) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """Compare a freshly loaded model's non-persistent buffers with its constructor's (a twin's); with `recompute`,
    put back every one that differs (report key `recomputed`), else record them and leave them as they are
    (`left_as_loaded`: uninitialised memory is often zeros, finite but wrong, as seen on the H200, so a finiteness
    check alone misses it). Return (the model's buffers now, for the restore after the engine; report)."""
    import time

    t0 = time.perf_counter()
    expected = snapshot(build_on_meta(ctx))
    nonfinite_as_loaded = nonfinite(non_persistent_buffers(model), on_host=True)
    wrong, gone = differences(model, expected)
    if recompute:
        put_back(model, expected, wrong, "cpu")
    kept = non_persistent_buffers(model)  # the model's own where they were right, the twin's where they were not
    return kept, {
        ("recomputed" if recompute else "left_as_loaded"): wrong,
        "checked": len(expected),
        "nonfinite_as_loaded": nonfinite_as_loaded,
        "not_found": gone,
        "seconds": time.perf_counter() - t0,
    }


def built_report(originals: Dict[str, Any]) -> Dict[str, Any]:
    """The after-load buffer report of a model built by `build_on_meta`: its buffers are the constructor's."""
    return {
        "recomputed": {},
        "checked": len(originals),
        "nonfinite_as_loaded": nonfinite(originals, on_host=True),
        "from_constructor": True,
    }


def restoring(ctx, originals: Dict[str, Any], fix: Optional[Callable[[Any], Dict[str, Any]]] = None):
    """A loader's `finalize`: its own fix-up `fix` (what it did, as a dict), then, with load.restore_buffers,
    the buffers put back as they were right after the load (under "buffers")."""

    def finalize(module) -> Dict[str, Any]:
        report = fix(module) if fix else {}
        if ctx.spec.load.restore_buffers:
            report["buffers"] = restore(module, originals, ctx.device)
        else:  # what the engine left differing from the constructor's buffers, kept as it is
            report["buffers"] = {"left_by_engine": differences(module, originals)[0]}
        return report

    return finalize
