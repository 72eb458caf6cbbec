"""The trims (`trim=` group): which engines each applies to, the rank environment they may set, and the rule that
finds identical buffers, shared by the ranks (who share them) and the memory model (who predicts it).

Standard library only: validation, the ranks and the analysis all read this module.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Iterable, Iterator, List, Optional, Tuple

# The model trims, in the order the report lists them.
MODEL_TRIMS = ("dedupe_buffers", "shard_head", "shard_embedding", "world_group")
SHORT = {"dedupe_buffers": "dedupe", "shard_head": "head", "shard_embedding": "emb", "world_group": "world"}
# Trims that change DeepSpeed's AutoTP call: engine=init_inference without kernel injection only.
AUTOTP_ONLY = ("shard_head", "shard_embedding", "world_group")

# trim.env: the settings of the memory outside PyTorch's allocator (and of the allocator itself).
ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ENV_NAMES = (
    "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
)
ENV_FIXED = {"NCCL_NVLS_ENABLE": "dsexp sets it to 0 for every job (NVLink multicast stays off)"}


def env_problem(key: str, value: Any) -> Optional[str]:
    """Why `trim.env.<key>` cannot be set (None: it can)."""
    if key in ENV_FIXED:
        return f"trim.env.{key}: {ENV_FIXED[key]}; it cannot be changed here"
    if not (key.startswith(ENV_PREFIXES) or key in ENV_NAMES):
        return (
            f"trim.env.{key} is not a setting dsexp passes to the ranks; allowed: names starting with "
            f"{', '.join(ENV_PREFIXES)} or one of {', '.join(ENV_NAMES)}"
        )
    if not isinstance(value, (str, int, float, bool)) or value == "":
        return f"trim.env.{key}={value!r}: give a non-empty string or number"
    return None


def env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def active(trim: Any) -> List[str]:
    """The model trims switched on in a trim config (a TrimConfig or its dict)."""
    get = trim.get if isinstance(trim, dict) else lambda k, d=None: getattr(trim, k, d)
    return [k for k in MODEL_TRIMS if get(k, False)]


def label(trim: Optional[Dict[str, Any]]) -> Optional[str]:
    """A short name for a configuration's trims, e.g. "trim(dedupe,head)+env(NCCL_MAX_NCHANNELS=8)"; None: none."""
    trim = trim or {}
    parts = []
    on = active(trim)
    if on:
        parts.append("trim(" + ",".join(SHORT[k] for k in on) + ")")
    env = trim.get("env") or {}
    if env:
        parts.append("env(" + ",".join(f"{k}={env_value(v)}" for k, v in sorted(env.items())) + ")")
    return "+".join(parts) or None


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


def owner_of(module, name: str) -> Tuple[Any, str]:
    """(the submodule holding `name`, the attribute) — (None, attribute) where the engine replaced the owner."""
    owner_name, _, leaf = name.rpartition(".")
    try:
        return module.get_submodule(owner_name), leaf
    except AttributeError:  # e.g. kernel injection replaced the layer
        return None, leaf


def non_persistent_buffers(model, include_meta: bool = False) -> Iterator[Tuple[str, Any, str, Any]]:
    """(qualified name, owner module, attribute, tensor) of every non-persistent buffer of a torch module that holds
    data (not on meta, unless include_meta). Duck-typed: this module imports no torch."""
    for mod_name, mod in model.named_modules():
        for leaf, buf in mod._buffers.items():
            if buf is not None and leaf in mod._non_persistent_buffers_set and (include_meta or not buf.is_meta):
                yield (f"{mod_name}.{leaf}" if mod_name else leaf), mod, leaf, buf


def duplicate_buffers(model, equal: Callable[[Any, Any], bool]) -> Dict[str, str]:
    """{buffer name: the first buffer with the same attribute name, dtype, shape, strides, device and values
    (`equal`, e.g. torch.equal)} over the model's non-persistent buffers: what trim.dedupe_buffers shares."""
    items = (
        (name, (leaf, str(buf.dtype), tuple(buf.shape), tuple(buf.stride()), str(buf.device)), buf)
        for name, _, leaf, buf in non_persistent_buffers(model)
    )
    return identical(items, lambda a, b: a is b or equal(a, b))
