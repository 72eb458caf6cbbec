"""The trims on a rank (`trim=` group): what stays replicated on every device, removed with DeepSpeed's own layers.

- shard_head: DeepSpeed's AutoTP splits a top-level head only if it is named `lm_head` or `embed_out`
  (module_inject/replace_module.py `set_lm_head`). While `init_inference` runs, the head is also registered as
  `lm_head` (the same module under two names: the checkpoint loader still finds `output.weight`), so DeepSpeed
  replaces it with its LmHeadLinearAllreduce (weight split on the hidden dim, partial logits all-reduced); the
  replacement is then put back under the head's own name and the alias removed.
- shard_embedding: DeepSpeed's VocabParallelEmbedding (module_inject/layers.py; vocabulary rows split, lookups
  outside a rank's rows zeroed, partial results all-reduced), which AutoTP inference never applies itself. Built
  before `init_inference` when the weights are on the host or on meta without a DeepSpeed checkpoint (the full
  table never reaches the device), after it when DeepSpeed fills the model from `checkpoint=` (DeepSpeed's loader
  fills nn.Embedding only), moving the full table off the device first.
- world_group: DeepSpeed's inference engine creates its own tensor-parallel group (`dist.new_group`, a second NCCL
  communicator) even when tp is the world size, unless `InferenceEngine.inference_mp_group` is already set: we
  set it to the world group. The same attribute hands DeepSpeed the group we built for a VocabParallelEmbedding
  made before init (the group DeepSpeed would make: `new_group(range(tp))`).
- dedupe_buffers: identical non-persistent buffers (InternLM2 keeps per-layer rotary cos/sin tables computed from
  one config) point at one tensor. Moving or casting a module converts each owner's buffer separately, so sharing
  only holds once the engine has placed the model; to keep the copies off the device while it does, the
  duplicates found before the engine are taken out of their modules (`hold_duplicates`) and put back after it as
  the placed tensor of the first of their group (`dedupe_buffers`), which then shares what the engine left.

Imports torch, DeepSpeed and dsexp.core only (the rank never loads the job side).
"""

from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Tuple

from dsexp.core.trims import duplicate_buffers, non_persistent_buffers, owner_of

HEAD_NAMES = ("lm_head", "embed_out")  # the names DeepSpeed's set_lm_head looks for


def _nbytes(t) -> int:
    return t.numel() * t.element_size()


def _empty_cache(device_type: str) -> None:
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()


def env_seen(keys: Iterable[str]) -> Dict[str, Optional[str]]:
    """What this rank's environment holds for the trim.env keys (proof they reached it)."""
    return {k: os.environ.get(k) for k in sorted(keys)}


# --- dedupe_buffers ------------------------------------------------------------------------------------------


def duplicates(model) -> Dict[str, str]:
    import torch

    return duplicate_buffers(model, torch.equal)


class HeldBuffers:
    """Duplicates taken out of their modules before the engine places the model (the device gets one copy each)."""

    def __init__(self, model):
        self.of = duplicates(model)  # held name -> the name of the buffer it will share
        self.held: Dict[str, Any] = {}
        for name in self.of:
            owner, leaf = owner_of(model, name)
            self.held[name] = owner._buffers.pop(leaf)
            owner._non_persistent_buffers_set.discard(leaf)

    def put_back(self, module) -> Dict[str, int]:
        """Register every held buffer again, as the placed tensor of the first of its group (or, if the engine
        replaced that one's owner, as its own copy on the device of the model's parameters)."""
        shared = own = gone = 0
        for name, first in self.of.items():
            owner, leaf = owner_of(module, name)
            if owner is None:
                gone += 1
                continue
            src_owner, src_leaf = owner_of(module, first)
            tensor = src_owner._buffers.get(src_leaf) if src_owner is not None else None
            if tensor is None or tensor.shape != self.held[name].shape:
                device = next((p.device for p in module.parameters() if not p.is_meta), self.held[name].device)
                tensor, own = self.held[name].to(device), own + 1
            else:
                shared += 1
            owner.register_buffer(leaf, tensor, persistent=False)
        self.held.clear()
        return {"held_before_engine": len(self.of), "put_back_shared": shared, "put_back_own": own, "owner_gone": gone}


def dedupe_buffers(module, held: Optional[HeldBuffers], device_type: str) -> Dict[str, Any]:
    """After the engine (and the loader's buffer restore): put held duplicates back, then point every remaining
    identical non-persistent buffer at the first of its group. Returns what it did, bytes on this rank."""
    report: Dict[str, Any] = held.put_back(module) if held is not None else {"held_before_engine": 0}
    before = {name: buf for name, _, _, buf in non_persistent_buffers(module)}
    found = {n: first for n, first in duplicates(module).items() if before[n] is not before[first]}
    for name, first in found.items():
        owner, leaf = owner_of(module, name)
        owner._buffers[leaf] = before[first]
    after = {id(b): b for _, _, _, b in non_persistent_buffers(module)}
    _empty_cache(device_type)
    report.update(
        {
            "buffers": len(before),
            "distinct_after": len(after),
            "shared_after_engine": len(found),
            "bytes_before": sum(_nbytes(b) for b in before.values()),  # each buffer its own copy: without the trim
            "bytes_after": sum(_nbytes(b) for b in after.values()),
        }
    )
    return report


# --- shard_head ----------------------------------------------------------------------------------------------


def head_attr(model) -> str:
    """The top-level attribute holding the output head (DeepSpeed's set_lm_head only looks at top-level ones)."""
    head = model.get_output_embeddings()
    name = next((n for n, m in model._modules.items() if m is head), None) if head is not None else None
    if name is None:
        raise RuntimeError(
            "trim.shard_head: the model's output head is not a top-level module "
            f"({type(head).__name__ if head is not None else 'none'}); DeepSpeed's set_lm_head only splits "
            "model.lm_head / model.embed_out"
        )
    return name


def alias_head(model) -> Tuple[Optional[str], Dict[str, Any]]:
    """Before init_inference: register the head also as `lm_head`. Returns (attribute aliased or None, report)."""
    import torch.nn as nn

    attr = head_attr(model)
    head = model._modules[attr]
    report: Dict[str, Any] = {"module": attr, "bytes_before": sum(_nbytes(p) for p in head.parameters())}
    if attr in HEAD_NAMES:
        return None, {**report, "skipped": f"named {attr}: DeepSpeed's AutoTP splits it without the trim"}
    if not isinstance(head, nn.Linear):
        raise RuntimeError(f"trim.shard_head: the output head {attr} is {type(head).__name__}, not nn.Linear")
    if any(n in model._modules for n in HEAD_NAMES):
        raise RuntimeError(f"trim.shard_head: the model already has a module named {HEAD_NAMES}, besides {attr}")
    model._modules["lm_head"] = head
    return attr, report


def unalias_head(module, attr: str, report: Dict[str, Any]) -> Dict[str, Any]:
    """After init_inference: DeepSpeed's replacement goes back under the head's own name, the alias goes."""
    new = module._modules.pop("lm_head")
    module._modules[attr] = new
    local = [p.to_local() if hasattr(p, "to_local") else p for p in new.parameters()]
    return {
        **report,
        "replaced_by": type(new).__name__,
        "bytes_after": sum(_nbytes(p) for p in local if not p.is_meta),
        "shape_after": [list(p.shape) for p in local],
        "how": "aliased as lm_head during init_inference (DeepSpeed's set_lm_head)",
    }


# --- the tensor-parallel group -------------------------------------------------------------------------------


def preset_group(world: bool, tp: int) -> Tuple[Any, Dict[str, Any]]:
    """Hand DeepSpeed's inference engine its tensor-parallel group before init_inference: the world group
    (world=True, tp == world size: one NCCL communicator fewer) or the group DeepSpeed would create itself."""
    import torch.distributed as tdist
    from deepspeed import comm as dist
    from deepspeed.inference.engine import InferenceEngine

    if InferenceEngine.inference_mp_group is not None:
        return InferenceEngine.inference_mp_group, {"group": "already set"}
    if world:
        if tdist.get_world_size() != tp:
            raise RuntimeError(f"trim.world_group needs tp == world size, got tp={tp}, {tdist.get_world_size()}")
        group, what = tdist.group.WORLD, "world (no communicator of DeepSpeed's own)"
    else:
        group, what = dist.new_group(list(range(tp))), "new_group(range(tp)), as DeepSpeed makes it"
    InferenceEngine.inference_mp_group = group
    return group, {"group": what}


# --- shard_embedding -----------------------------------------------------------------------------------------


def vocab_parallel_embedding():
    """DeepSpeed's VocabParallelEmbedding, or a clear error naming the installed version (0.14.4 has none)."""
    try:
        from deepspeed.module_inject.layers import VocabParallelEmbedding
    except ImportError:
        import deepspeed

        raise RuntimeError(
            f"trim.shard_embedding needs DeepSpeed's VocabParallelEmbedding (deepspeed.module_inject.layers), "
            f"which deepspeed {deepspeed.__version__} does not have (0.19.8 has it)"
        ) from None
    return VocabParallelEmbedding


def shard_embedding(model, group, grain: int, when: str) -> Dict[str, Any]:
    """Replace the input embedding by DeepSpeed's VocabParallelEmbedding on `group` (rows split as AutoTP splits:
    get_shard_size_list with the model's AutoTPMeta and the embedding's qualified name)."""
    import torch.nn as nn
    from deepspeed.module_inject.tp_shard import AutoTPMeta

    vpe = vocab_parallel_embedding()
    emb = model.get_input_embeddings()
    name = next(n for n, m in model.named_modules() if m is emb)
    if type(emb) is not nn.Embedding:
        raise RuntimeError(f"trim.shard_embedding: {name} is {type(emb).__name__}, not nn.Embedding")
    before = _nbytes(emb.weight)
    device_type = emb.weight.device.type
    if device_type not in ("cpu", "meta"):  # after init: the full table leaves the device before the split
        emb.to("cpu")
        _empty_cache(device_type)
    new = vpe(emb, group, name=name, tp_meta=AutoTPMeta.from_model_config(model.config, grain))
    model.set_input_embeddings(new)
    return {
        "module": name,
        "replaced_by": type(new).__name__,
        "when": when,
        "rows": [new.vocab_start_index, new.vocab_end_index],
        "bytes_before": before,
        "bytes_after": _nbytes(new.weight),
    }
