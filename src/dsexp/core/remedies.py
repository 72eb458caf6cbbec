"""The remedies `script.fix` can apply to a user's script: their names, what each does, and when one cannot apply
(known before launch). Standard library only: validation reads it, and the script's ranks apply the remedies
(dsexp.rank.workloads.script.fixes)."""

from __future__ import annotations

from typing import Dict, List, Optional

FIXES: Dict[str, str] = {
    "host_load": "keep the model on the host until the engine places it",
    "autotp": "AutoTP with the inferred policy instead of kernel injection DeepSpeed has no policy for",
    "drop_unread": "drop what DeepSpeed never reads (init_inference's zero=) or rejects (a field its version refuses)",
    "restore_buffers": "recompute the loaded buffers from the model's own constructor",
    "meta_load": "build on meta and let init_inference load each rank's part (no private host copy per rank)",
    "trims": "dsexp's trims: one communicator, head and embedding sharded, identical buffers shared",
    "context": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True",
}
ORDER = tuple(FIXES)
# the remedies whose arithmetic differs from the script as written, and how: where a fixed variant's tokens differ
# from the as-written run's, these are the causes the report names (the others move bytes, not numbers)
CHANGES_NUMBERS: Dict[str, str] = {
    "autotp": "torch's matmuls over split weights instead of DeepSpeed's fused kernels",
    "restore_buffers": "the rotary tables recomputed in fp32 by the model's constructor, not as loaded",
    "trims": "the head and embedding sharded: each rank's partial logits gathered",
}
CONTEXT_ENV = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
TRIMS_DEEPSPEED = "0.19.8"  # VocabParallelEmbedding (shard_embedding); shard_head needs >= 0.15


def resolve(names: List[str]) -> List[str]:
    return list(ORDER) if "all" in names else [n for n in ORDER if n in names]


def not_applicable(name: str, spec) -> Optional[str]:
    """Why a remedy cannot apply to this job, known before launch (None: it may apply; the run says if it did)."""
    from dsexp.core.schema import version_tuple

    ds = getattr(spec.stack, "deepspeed", None)
    if name == "context" and spec.device == "cpu":
        return "context sets the CUDA caching allocator: there is none on device=cpu"
    if name == "trims" and ds and str(ds)[0].isdigit() and version_tuple(ds) < version_tuple(TRIMS_DEEPSPEED):
        return f"trims need DeepSpeed >= {TRIMS_DEEPSPEED} (VocabParallelEmbedding); stack.deepspeed={ds}"
    if name == "trims" and spec.tp == 1:
        return "trims split across ranks: at tp=1 there is nothing to split"
    needs = ENGINE_NEEDED.get(name)
    if needs and not any(call in _source(spec) for call in needs):
        calls = " or ".join(f"deepspeed.{call}...)" for call in needs)
        return f"{name} hands the model to {calls}, which {spec.script.path} never calls"
    return None


# remedies that leave the model for the engine to place or fill: without that call the script would run on a model
# its own code no longer put where it asked (host_load) or never filled (meta_load); found as the calls are written
ENGINE_NEEDED = {"host_load": ("init_inference(", "initialize("), "meta_load": ("init_inference(",)}


def _source(spec) -> str:
    """The script's text (where it cannot be read, one naming both calls: every remedy may apply, the run says)."""
    path = getattr(getattr(spec, "script", None), "path", None)
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except (OSError, TypeError):
        return "init_inference( initialize("


def fix_problem(fixes: List[str], spec) -> Optional[str]:
    """Before launch: an unknown remedy, or one asked for by name that cannot apply here, with the reason."""
    unknown = [f for f in fixes if f != "all" and f not in FIXES]
    if unknown:
        return f"script.fix: unknown remedy {unknown[0]!r}; choose from: all, {', '.join(FIXES)}"
    for name in fixes:
        why = None if name == "all" else not_applicable(name, spec)
        if why:
            return f"script.fix={name} cannot apply: {why}"
    return None


def context_env(names: List[str], device: str) -> Dict[str, str]:
    """What the context remedy sets in the rank's environment before torch starts CUDA."""
    return dict(CONTEXT_ENV) if "context" in resolve(names) and device == "cuda" else {}
