"""What a generate's events depend on in a model, as data two copies of one structure share: dsexp.predict.fragmentation
keeps its traces by the model's `fingerprint`, and dsexp.predict.layer_steps compares decoder layers by the same
parts."""

from __future__ import annotations

import hashlib
import inspect


def fingerprint(model) -> str:
    """What a generate's events depend on in `model`, as a digest: its class and configs and, per module, its class,
    tensors (shapes, strides, dtypes), plain attributes (the heads AutoTP tells it it has), hooks and a replaced
    forward. Copies of one structure share it; an id would not outlive its model."""
    parts = [described(type(model)), config_text(model, "config"), config_text(model, "generation_config")]
    for name, module in model.named_modules():
        parts.append((name, described(type(module)), tensors(module), attributes(module), hooks(module)))
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def config_text(model, name: str) -> str:
    config = getattr(model, name, None)
    try:
        return config.to_json_string() if config is not None else ""
    except (TypeError, ValueError):
        return repr(sorted(vars(config).items()))


def tensors(module) -> list:
    own = [*module._parameters.items(), *module._buffers.items()]
    return [(n, *tensor_parts(t)) for n, t in own if t is not None]


def tensor_parts(t) -> tuple:
    """A tensor's shape, strides, dtype and device; a wrapper subclass (a quantized weight) with its class, its inner
    tensors' and its flatten context (the settings it carries): fp8 and int8 weights of one shape make different
    generates, and so do fp8 weights with and without fp8 activations (torchao's act_quant_kwargs)."""
    from dsexp.core.tensors import is_wrapper

    parts = (tuple(t.shape), t.stride(), str(t.dtype), str(t.device))
    if is_wrapper(t):
        names, context = t.__tensor_flatten__()
        inner = tuple(tensor_parts(getattr(t, n)) for n in names if getattr(t, n, None) is not None)
        settings = sorted((str(k), described(v)) for k, v in context.items()) if isinstance(context, dict) else context
        return (*parts, described(type(t)), inner, described(settings))
    return parts


def attributes(module) -> list:
    return sorted((k, described(v)) for k, v in vars(module).items() if not k.startswith("_"))


def hooks(module) -> list:
    out = []
    for kind in ("_forward_pre_hooks", "_forward_hooks"):
        with_kwargs = getattr(module, kind + "_with_kwargs", {})
        out.append([(described(fn), i in with_kwargs) for i, fn in getattr(module, kind, {}).items()])
    return out


PLAIN = (int, float, bool, str, bytes, type(None))


def described(obj, depth: int = 0):
    """`obj` as a fingerprint holds it: plain values and their tuples and lists as they are, a class or function by
    its name (a closure with its cells), a bound method by its function and its object's class; anything else, or
    nested deeper than a few levels, by its class alone (a hook's report, a module's config: state the generate does
    not size anything by)."""
    if isinstance(obj, PLAIN):
        return obj
    if isinstance(obj, type):
        return f"{obj.__module__}.{obj.__qualname__}"
    if depth > 4:
        return described(type(obj))
    if isinstance(obj, (tuple, list)):
        return tuple(described(v, depth + 1) for v in obj)
    if inspect.ismethod(obj):
        return ("method", described(obj.__func__, depth + 1), described(type(obj.__self__)))
    if inspect.isfunction(obj):
        cells = tuple(described(cell_contents(c), depth + 1) for c in obj.__closure__ or ())
        return ("function", obj.__module__, obj.__qualname__, cells)
    return described(type(obj))


def cell_contents(cell):
    try:
        return cell.cell_contents
    except ValueError:  # an empty cell
        return None
