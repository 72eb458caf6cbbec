"""`load=meta`: the model is built on the meta device and DeepSpeed's AutoTP fills each rank's slices.

`init_inference(checkpoint={"type": "ds_model", "checkpoints": [files]})` reads the files one by one
on every rank (module_inject/replace_module.py: `replace_transformer_layer` -> `replace_module`, which
`load_file`s / `torch.load`s the whole file) and copies each module's slice out of it
(auto_tp.py: `Loading.load`). What that path gets wrong in DeepSpeed 0.19.8, and what we do:

- Non-persistent buffers (RoPE `inv_freq`) are in no checkpoint; `Loading.load_buffer` gives a meta
  buffer `torch.empty` memory. We build the model with parameters on meta but buffers real (computed
  by the model's own constructor) and restore them after init (buffers.py), which also undoes the
  engine's cast of them to the run dtype.
- `Loading.is_load_module` knows nn.Linear/Embedding/LayerNorm and a fixed list of class names
  (LlamaRMSNorm, Qwen2RMSNorm, ...): any other norm (e.g. InternLM2RMSNorm) stays on meta and
  `init_inference` fails moving it. We register every unknown norm-like leaf module (only 1-D
  `weight`/`bias` parameters) for the duration of the run.
- A parameter DeepSpeed cannot fill (owned by a module it does not load, or absent from the files)
  is an error before init_inference, naming each one and why.
- DeepSpeed reads `checkpoint=` only inside `_apply_injection_policy` (inference/engine.py), which runs
  at tp_size > 1 or with kernel injection; at tp=1 it silently leaves the model on meta and
  `to_empty` hands out uninitialised memory. There we fill the model ourselves after init
  (files.fill), so meta at tp=1 is correct and shows the cost of a streaming load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List

from dsexp.core.context import RankContext
from dsexp.rank.loading import buffers, files
from dsexp.rank.loading.base import Loaded, Loader
from dsexp.rank.loading.buffers import build_on_meta


def deepspeed_fills(ctx: RankContext) -> bool:
    """Whether init_inference will read `checkpoint=` (see the module docstring)."""
    return ctx.world_size > 1 or ctx.spec.engine.kernel_inject


def ds_checkpoint(paths: Iterable[Path]) -> Dict[str, Any]:
    """DeepSpeed's checkpoint description; absolute paths because DeepSpeed joins them to `base_dir`."""
    return {"type": "ds_model", "checkpoints": [str(Path(p).resolve()) for p in paths], "version": 1.0}


def unknown_norms(model) -> Dict[str, type]:
    """Leaf modules with only 1-D weight/bias parameters that DeepSpeed's checkpoint loader would skip."""
    from deepspeed.module_inject.auto_tp import Loading

    found: Dict[str, type] = {}
    for mod in model.modules():
        params = dict(mod.named_parameters(recurse=False))
        if not params or next(mod.children(), None) is not None or Loading.is_load_module(mod):
            continue
        if set(params) <= {"weight", "bias"} and all(p.dim() == 1 for p in params.values()):
            found[type(mod).__name__] = type(mod)
    return found


def register_load_modules(classes: Iterable[type]) -> Callable[[], None]:
    """Make `Loading.is_load_module` also accept `classes`; returns the undo."""
    from deepspeed.module_inject.auto_tp import Loading

    extra = tuple(classes)
    original = Loading.__dict__["is_load_module"]

    def is_load_module(module):
        return original(module) or isinstance(module, extra)

    Loading.is_load_module = is_load_module
    return lambda: setattr(Loading, "is_load_module", original)


def unfillable(model, checkpoint_keys: set) -> Dict[str, str]:
    """Parameters DeepSpeed's AutoTP checkpoint path would leave on meta, with the reason for each."""
    from deepspeed.module_inject.auto_tp import Loading

    reasons: Dict[str, str] = {}
    seen = set()
    for mod_name, mod in model.named_modules():
        for pname, p in mod.named_parameters(recurse=False):
            if id(p) in seen:  # tied: filled through its first name
                continue
            seen.add(id(p))
            name = f"{mod_name}.{pname}" if mod_name else pname
            if not Loading.is_load_module(mod) or pname not in ("weight", "bias"):
                reasons[name] = (
                    f"{type(mod).__name__} is not a module DeepSpeed's checkpoint loader fills "
                    f"(auto_tp.Loading loads weight/bias of Linear, Embedding and known norms)"
                )
            elif name not in checkpoint_keys:
                reasons[name] = "not in any checkpoint file"
    return reasons


def tied_names(model) -> Dict[str, str]:
    """{alias: name} for every parameter the model holds under several names (a head tied to its embedding)."""
    first: Dict[int, str] = {}
    tied: Dict[str, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        tied.update({name: first[id(p)]} if id(p) in first else {})
        first.setdefault(id(p), name)
    return tied


def names_deepspeed_looks_up(model, keys: set) -> List[tuple]:
    """[(the name DeepSpeed looks up, the file's name)] where they differ: for Bloom and OPT models DeepSpeed drops
    the first level of every name below the top (`transformer.`), as the original checkpoints were saved; files saved
    by transformers keep it."""
    from deepspeed.module_inject.replace_module import skip_level_0_prefix

    if not skip_level_0_prefix(model, dict.fromkeys(keys)):
        return []
    out = []
    for name, _ in model.named_parameters():
        parts = name.split(".", 1)
        if len(parts) == 2 and "." in parts[1] and parts[1] not in keys and name in keys:
            out.append((parts[1], name))
    return out


def _meta_leftovers(module) -> List[str]:
    return [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]


class MetaLoader(Loader):
    name = "meta"

    def load(self, ctx: RankContext, hf_kwargs: Dict[str, Any]) -> Loaded:
        model = build_on_meta(ctx)
        originals = buffers.snapshot(model)
        paths = files.checkpoint_files(ctx.model_dir, ctx.spec.load.format)
        if not deepspeed_fills(ctx):
            tied = tied_names(model)  # the engine's placement (to_empty) unties a tied head: the fill ties it again
            fill = buffers.restoring(
                ctx, originals, lambda m: {"filled_by": "dsexp", "fill": files.fill(m, paths, tied)}
            )
            return Loaded(
                model,
                finalize=fill,
                info={
                    "buffers": buffers.built_report(originals),
                    "filled_by": "dsexp",
                    "why": "DeepSpeed ignores checkpoint= at tp=1 without "
                    "kernel injection (no _apply_injection_policy)",
                },
            )
        norms = unknown_norms(model)
        undo = register_load_modules(norms.values())
        if not ctx.spec.engine.kernel_inject:  # kernel injection loads through its containers instead
            self._precheck(model, paths, undo)
        return Loaded(
            model,
            checkpoint=ds_checkpoint(paths),
            finalize=buffers.restoring(ctx, originals, lambda m: self._check_after(m, undo)),
            info={
                "buffers": buffers.built_report(originals),
                "filled_by": "deepspeed",
                "files": len(paths),
                "registered_load_modules": sorted(norms),
            },
        )

    @staticmethod
    def _precheck(model, paths: List[Path], undo: Callable[[], None]) -> None:
        keys = {k for p in paths for k in files.tensor_names(p)}
        renamed = names_deepspeed_looks_up(model, keys)
        if renamed:
            undo()
            raise RuntimeError(
                f"load=meta: DeepSpeed's checkpoint loader looks these tensors up without their first name level "
                f"(replace_module.skip_level_0_prefix, for {type(model).__name__}), which the files keep: "
                + "; ".join(f"{want!r} (the files: {have!r})" for want, have in renamed[:3])
            )
        missing = unfillable(model, keys)
        if missing:
            undo()
            listed = "; ".join(f"{n}: {why}" for n, why in list(missing.items())[:8])
            raise RuntimeError(
                f"load=meta: init_inference would leave {len(missing)} parameters on the meta device "
                f"(uninitialised, or failing to move): {listed}"
            )

    @staticmethod
    def _check_after(module, undo: Callable[[], None]) -> Dict[str, Any]:
        undo()
        left = _meta_leftovers(module)
        if left:
            raise RuntimeError(
                f"load=meta: {len(left)} tensors are still on the meta device after "
                f"init_inference(checkpoint=...): DeepSpeed's AutoTP loader did not fill them "
                f"(not loaded by auto_tp.Loading, or their names did not match the files): "
                f"{', '.join(left[:8])}"
            )
        return {"filled_by": "deepspeed"}
