"""quant.kv: a quantized KV cache through transformers' own QuantizedCache (`generate(cache_implementation=
"quantized", cache_config={backend, nbits, q_group_size, residual_length})`), with any weight member.

The cache quantizes the prompt's keys and values at the prefill, keeps the newest decode tokens in the run dtype
(fewer than `quant.kv_residual`) and, when they reach it, dequantizes the whole layer, appends them and quantizes it
again. Its rule (dsexp.predict.kv.cache_bytes, in the memory model): a quantized token costs bits/8 bytes per element
plus a scale and a shift in the run dtype per group of `kv_group_size` elements (quanto's layout; hqq's is the same
count at 8, 4 and 2 bits)."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from dsexp.predict.kv import cache_bytes, quantized_bytes, split_tokens  # noqa: F401  (the rule, in the memory model)

BACKENDS: Dict[str, Tuple[int, ...]] = {"quanto": (4, 2), "hqq": (8, 4, 2)}
PACKAGES = {"quanto": "optimum-quanto", "hqq": "hqq"}


def generate_kwargs(quant: Any) -> Dict[str, Any]:
    """transformers' generate arguments for the quantized cache ({} without quant.kv)."""
    get = quant.get if isinstance(quant, dict) else lambda k, d=None: getattr(quant, k, d)
    bits = get("kv")
    if bits is None:
        return {}
    return {
        "cache_implementation": "quantized",
        "cache_config": {
            "backend": get("kv_backend", "quanto"),
            "nbits": int(bits),
            "q_group_size": int(get("kv_group_size", 64)),
            "residual_length": int(get("kv_residual", 128)),
        },
    }


def problem(quant: Any, model_dims: Dict[str, Any], kernel_inject: bool) -> Optional[str]:
    """Why quant.kv cannot run here (None: it can): a backend or a width it does not have, DeepSpeed's kernels
    (their own KV workspace, no transformers cache), a model whose attention is not full (sliding windows)."""
    get = quant.get if isinstance(quant, dict) else lambda k, d=None: getattr(quant, k, d)
    bits, backend = get("kv"), get("kv_backend", "quanto")
    if bits is None:
        return None
    if backend not in BACKENDS:
        return (
            f"quant.kv_backend={backend!r} is not one of transformers' QuantizedCache backends: {', '.join(BACKENDS)}"
        )
    if int(bits) not in BACKENDS[backend]:
        widths = ", ".join(map(str, BACKENDS[backend]))
        other = [b for b, w in BACKENDS.items() if int(bits) in w]
        hint = f"; quant.kv_backend={other[0]} has {bits} bits" if other else ""
        return f"quant.kv={bits} with quant.kv_backend={backend}: it quantizes to {widths} bits{hint}"
    if kernel_inject:
        return (
            f"quant.kv={bits} with engine.kernel_inject=true: DeepSpeed's kernels keep the KV cache in their own "
            "workspace, not in a transformers cache; set engine.kernel_inject=false"
        )
    window = model_dims.get("sliding_window")
    types = model_dims.get("layer_types") or []
    if window or any("sliding" in str(t) for t in types):
        return (
            f"quant.kv={bits}: the model's attention keeps a sliding window (sliding_window={window}), and "
            "transformers' QuantizedCache supports full attention only; leave quant.kv unset"
        )
    if int(get("kv_group_size", 64)) <= 0 or int(get("kv_residual", 128)) < 0:
        return "quant.kv_group_size must be > 0 and quant.kv_residual >= 0"
    return None
