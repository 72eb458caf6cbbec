"""What each observed call of a user's script did, as plain data: its arguments as given, where the model's
parameters were when it began and ended, what the engine replaced and which of its arguments DeepSpeed read.

`*_before(args, kwargs)` and `*_after(out, args, kwargs)` return dicts merged into the call's record; the ones that
need the session (to annotate the phase, to register an end-of-run finisher) are built from it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
from typing import Any, Dict, Optional

from dsexp.core.protocol import logits_file

LOAD_ARGS = (
    "torch_dtype",
    "dtype",
    "device_map",
    "low_cpu_mem_usage",
    "tp_plan",
    "tp_size",
    "trust_remote_code",
    "attn_implementation",
    "offload_folder",
    "max_memory",
)
CONFIG_KEYS = (
    "model_type",
    "architectures",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
    "torch_dtype",
    "dtype",
)


def printable(v: Any, depth: int = 0) -> Any:
    """Plain data for a call's argument: pydantic configs as the fields set, classes and dtypes by name."""
    if depth > 4:
        return str(v)[:200]
    if hasattr(v, "model_fields_set"):  # a pydantic config (DeepSpeedTPConfig, DeepSpeedZeroConfig): what was set
        return {k: printable(getattr(v, k, None), depth + 1) for k in sorted(v.model_fields_set)}
    if isinstance(v, dict):
        return {getattr(k, "__name__", str(k)): printable(x, depth + 1) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [printable(x, depth + 1) for x in v][:50]
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, type):
        return v.__name__
    return str(v)[:200]


def placement(model) -> Dict[str, Any]:
    """Where the parameters and buffers are: bytes by device and by dtype (each storage once; a ZeRO-3 or DTensor
    parameter by its local part), and how many tensors sit on the meta device."""
    from dsexp.rank.probes.weights import _local

    by_device: Dict[str, int] = {}
    by_dtype: Dict[str, int] = {}
    seen, meta = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        loc = _local(t)
        if id(loc) in seen:
            continue
        seen.add(id(loc))
        n = loc.numel() * loc.element_size()
        dev = str(loc.device)
        by_device[dev] = by_device.get(dev, 0) + n
        dt = str(loc.dtype).replace("torch.", "")
        by_dtype[dt] = by_dtype.get(dt, 0) + n
        meta += loc.device.type == "meta"
    return {"by_device": by_device, "by_dtype": by_dtype, "bytes": sum(by_device.values()), "on_meta": meta}


def config_summary(config) -> Dict[str, Any]:
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    return {k: printable(d[k]) for k in CONFIG_KEYS if k in d} | {"auto_map": bool(d.get("auto_map"))}


def _annotate_weights(session, key: str, model) -> Dict[str, Any]:
    """The phase's device-resident weights, as dsexp's own phases record them (the report reads these)."""
    from dsexp.rank.probes.weights import resident_bytes, weight_census

    census = weight_census(model)
    device_type = "cuda" if session.on_gpu else "cpu"
    session.rec.annotate_phase(key, weights_device=resident_bytes(census, device_type), weights=census)
    return census


# --- load -------------------------------------------------------------------------------------------


def load_before(args: tuple, kwargs: dict) -> Dict[str, Any]:
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    out = {
        "source": printable(source),
        "source_expr": source_expression("from_pretrained", "pretrained_model_name_or_path"),
        "kwargs": {k: printable(kwargs[k]) for k in LOAD_ARGS if k in kwargs},
        "given": sorted(kwargs),
    }
    # a live HfDeepSpeedConfig with stage 3; without its module imported there is none (and importing it costs 0.3 s)
    out["zero3_enabled"] = False
    if "transformers.integrations.deepspeed" in sys.modules:
        with contextlib.suppress(Exception):
            out["zero3_enabled"] = bool(sys.modules["transformers.integrations.deepspeed"].is_deepspeed_zero3_enabled())
    return out


def pipeline_before(args: tuple, kwargs: dict) -> Dict[str, Any]:
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    out = {
        "source": printable(model if isinstance(model, str) else type(model).__name__),
        "task": printable(kwargs.get("task", args[0] if args else None)),
        "kwargs": {k: printable(kwargs[k]) for k in (*LOAD_ARGS, "device", "model_kwargs") if k in kwargs},
        "given": sorted(kwargs),
    }
    return out


def load_after(session):
    def after(out, args: tuple, kwargs: dict) -> Dict[str, Any]:
        model = out if _is_module(out) else getattr(out, "model", out)  # a pipeline holds its model
        session.model = model
        _annotate_weights(session, session.last_phase, model)
        from dsexp.rank.loading.buffers import non_persistent_buffers, nonfinite

        return {
            "model_class": type(model).__name__,
            "config": config_summary(getattr(model, "config", None)),
            "placement_after": placement(model),
            # published remote code computes these in __init__ only; transformers >= 5 may leave them uninitialised
            "nonfinite_buffers": nonfinite(non_persistent_buffers(model), on_host=True)[:20],
        }

    return after


def _is_module(obj) -> bool:
    import torch

    return isinstance(obj, torch.nn.Module)


# --- moves --------------------------------------------------------------------------------------------


def move_before(name: str):
    def before(model, args: tuple, kwargs: dict) -> Dict[str, Any]:
        return {
            "method": name,
            "target": printable([*args, *kwargs.values()]),
            "placement_before": placement(model),
        }

    return before


def move_after(session):
    def after(model, out, args: tuple, kwargs: dict) -> Dict[str, Any]:
        _annotate_weights(session, session.last_phase, out)
        return {"placement_after": placement(out)}

    return after


# --- engines ------------------------------------------------------------------------------------------

INFERENCE_CONFIGS = (
    ("deepspeed.inference.config", "DeepSpeedInferenceConfig"),
    ("deepspeed.inference.config", "DeepSpeedTPConfig"),
    ("deepspeed.runtime.zero.config", "DeepSpeedZeroConfig"),
)


def init_before(session):
    """deepspeed.init_inference(model, config=None, **kwargs): the arguments as given, where the model is, what
    kernel injection and AutoTP would find in it; DeepSpeed's reads of its config fields are traced from here."""

    def before(args: tuple, kwargs: dict) -> Dict[str, Any]:
        model = args[0] if args else kwargs.get("model")
        config = args[1] if len(args) > 1 else kwargs.get("config")
        given = {k: printable(v) for k, v in kwargs.items() if k != "model"}
        fields = sorted(k for k in kwargs if k not in ("model", "config"))
        if config is not None:
            given["config"] = printable(config)
            fields += sorted(config) if isinstance(config, dict) else []
        out: Dict[str, Any] = {"engine": "init_inference", "given": given, "placement_before": placement(model)}
        out.update(_model_facts(model, bool(kwargs.get("replace_with_kernel_inject"))))
        out["classes_before"] = _classes(model)
        _trace_fields(session, fields)
        return out

    return before


def initialize_before(args: tuple, kwargs: dict) -> Dict[str, Any]:
    model = kwargs.get("model", args[1] if len(args) > 1 else None)
    config = kwargs.get("config", kwargs.get("config_params"))
    zero = (config or {}).get("zero_optimization", {}) if isinstance(config, dict) else {}
    out: Dict[str, Any] = {
        "engine": "initialize",
        "given": {k: printable(v) for k, v in kwargs.items() if k != "model"},
        "zero_stage": zero.get("stage") if isinstance(zero, dict) else None,
    }
    if model is not None:
        out.update(placement_before=placement(model), classes_before=_classes(model), **_model_facts(model, False))
    return out


def init_after(session):
    def after(out, args: tuple, kwargs: dict) -> Dict[str, Any]:
        engine = out[0] if isinstance(out, tuple) else out
        module = getattr(engine, "module", engine)
        session.model = module
        census = _annotate_weights(session, session.last_phase, module)
        facts: Dict[str, Any] = {"placement_after": placement(module), "classes_after": census["module_classes"]}
        group = getattr(engine, "mp_group", None)
        if group is not None:
            with contextlib.suppress(Exception):
                import torch.distributed as dist

                facts["mp_world_size"] = dist.get_world_size(group)
        stage = getattr(engine, "zero_optimization_stage", None)
        if callable(stage):
            with contextlib.suppress(Exception):
                facts["zero_stage_used"] = stage()
        return facts

    return after


def _classes(model) -> Dict[str, int]:
    from dsexp.engines.rank import class_census

    return dict(class_census(model))


def _model_facts(model, kernel_inject: bool = False) -> Dict[str, Any]:
    """What kernel injection would find in the model (DeepSpeed's kernel-policy layers; none: it replaces nothing)
    and, where it finds none, the AutoTP policy to use instead (dsexp.models.policy: known layouts, DeepSpeed's
    parser, the structure). Asked only when kernel injection is asked for: both take a second or two."""
    out: Dict[str, Any] = {"model_class": type(model).__name__, "config": config_summary(model.config)}
    if not kernel_inject:
        return out
    from dsexp.models.kernel_policy import kernel_injected_layers
    from dsexp.models.policy import infer_policy

    out["kernel_policy_layers"] = kernel_injected_layers(model)
    if not out["kernel_policy_layers"]:
        found = infer_policy(model)
        out["autotp_policy"] = {k: found.get(k) for k in ("policy", "source", "why")}
    return out


def _trace_fields(session, given) -> None:
    """Trace which config fields DeepSpeed reads from now to the end of the run (init and generate)."""
    import importlib

    from dsexp.core.config_trace import FieldReadTracer

    classes = [getattr(importlib.import_module(mod), name) for mod, name in INFERENCE_CONFIGS]
    tracer = FieldReadTracer(classes).start()

    def unread() -> Dict[str, Any]:
        tracer.stop()
        return {
            "what": "init_inference fields read",
            "given": list(given),
            "unread": [f for f in given if not tracer.used("DeepSpeedInferenceConfig", _field(f))],
            "zero_fields_read": sorted(
                f for (cls, f), _ in tracer.reads.items() if cls == "DeepSpeedZeroConfig" and tracer.used(cls, f)
            ),
        }

    session.finishers.append(unread)


def _field(arg: str) -> str:
    """init_inference's keyword -> DeepSpeedInferenceConfig's field (aliases: mp_size is tensor_parallel)."""
    return {"mp_size": "tensor_parallel", "mpu": "tensor_parallel"}.get(arg, arg)


# --- generate -----------------------------------------------------------------------------------------


def generate_before(session):
    """generate(...): what it was asked, who called it (remote code's `chat`), the cap script.max_new_tokens puts
    on it; rank 0 keeps the first step's logits of the run's first generate (the correctness check reads them)."""

    def before(model, args: tuple, kwargs: dict) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "caller": _caller(),
            "kwargs": {k: printable(kwargs[k]) for k in ("max_new_tokens", "do_sample", "max_length") if k in kwargs},
        }
        cap = session.spec.script.max_new_tokens
        if cap is not None and int(kwargs.get("max_new_tokens") or 0) > cap:
            out["capped_from"] = kwargs["max_new_tokens"]
            kwargs["max_new_tokens"] = cap
        if session.rank == 0 and not session.logits_hooked:
            session.logits_hooked = True
            _keep_first_logits(session, model)
        return out

    return before


# frames between a script's call and dsexp's hook: the engine's own generate (DeepSpeed's InferenceEngine._generate)
# is the script's `engine.generate`, not a caller of its own
_WRAPPERS = ("/torch/", "/contextlib.py", "/functools.py", "/dsexp/rank/", "/deepspeed/")
_LIBRARIES = (*_WRAPPERS, "/transformers/", "/site-packages/", "/dist-packages/", "<frozen ")


def _caller() -> Optional[str]:
    """Where generate was called from: the file and line, and the function (remote code's `chat`, a pipeline's
    `_forward`, the script's own function) unless it was the script's top level: `main.py:37`,
    `modeling_internlm2.py:1180 chat`."""
    frame = sys._getframe(1)
    while frame is not None and (
        any(w in frame.f_code.co_filename for w in _WRAPPERS) or frame.f_code.co_name == "generate"
    ):
        frame = frame.f_back
    if frame is None:
        return None
    where = f"{frame.f_code.co_filename.rsplit('/', 1)[-1]}:{frame.f_lineno}"
    return where if frame.f_code.co_name == "<module>" else f"{where} {frame.f_code.co_name}"


def source_expression(method: str, keyword: str) -> Optional[str]:
    """The script's own source of the first argument it passed to `method` (e.g. `args.model_path`, `model_dir`), read
    from the line that made the call: the lines to change then use the script's names, not the value of this run.
    None where the caller is no file of the user's or the call is not found there."""
    import ast
    import linecache

    frame = sys._getframe(1)
    while frame is not None and any(w in frame.f_code.co_filename for w in _LIBRARIES):
        frame = frame.f_back
    if frame is None:
        return None
    text = "".join(linecache.getlines(frame.f_code.co_filename))
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    line = frame.f_lineno
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == method
            and node.lineno <= line <= (node.end_lineno or node.lineno)
        ):
            arg = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == keyword), None)
            return None if arg is None else ast.unparse(arg)
    return None


def generate_after(model, out, args: tuple, kwargs: dict) -> Dict[str, Any]:
    """What it generated: the positions added to each sequence (new_tokens), the sequences it returned (a batch of
    prompts, times num_return_sequences), their product (generated_tokens, the count tokens/s is of), and the first
    sequence's new token ids (its first KEPT_TOKENS)."""
    seqs = getattr(out, "sequences", out)
    prompt = kwargs.get("input_ids", args[0] if args else None)
    if hasattr(seqs, "shape") and hasattr(prompt, "shape"):
        new = int(seqs.shape[-1] - prompt.shape[-1])
        rows = int(seqs.shape[0]) if len(seqs.shape) > 1 else 1
        first = seqs[0] if len(seqs.shape) > 1 else seqs
        return {"prompt_tokens": int(prompt.shape[-1]), "new_tokens": new, "sequences": rows,
                "generated_tokens": new * rows,
                "tokens": [int(t) for t in first[prompt.shape[-1]:][:KEPT_TOKENS].tolist()]}  # fmt: skip
    return {}


KEPT_TOKENS = 64  # of the first sequence: what the report compares between a script as written and fixed


def _keep_first_logits(session, model) -> None:
    """A forward hook that saves the first forward's last-position logits (the first generated token's) once."""
    import torch

    handle = None

    def hook(module, inputs, output):
        logits = getattr(output, "logits", None)
        if logits is None and isinstance(output, tuple) and output:
            logits = output[0]
        if logits is not None:
            torch.save(logits[0, -1].detach().float().cpu(), logits_file(session.rec.path.parents[1]))
        handle.remove()

    handle = model.register_forward_hook(hook)


# --- see_memory_usage -----------------------------------------------------------------------------------


def torch_peaks(session) -> Dict[str, Any]:
    """The allocator's peaks now: DeepSpeed's see_memory_usage resets them right after printing."""
    if not session.on_gpu or "torch" not in sys.modules:
        return {}
    import torch

    if not torch.cuda.is_initialized():
        return {}
    return {
        "torch_max_allocated": torch.cuda.max_memory_allocated(),
        "torch_max_reserved": torch.cuda.max_memory_reserved(),
        "torch_allocated": torch.cuda.memory_allocated(),
    }


def tee_output(call) -> Dict[str, Any]:
    """Run see_memory_usage, letting its output through, and parse what it printed (dsexp.rank.probes.see_memory)."""
    from dsexp.rank.probes.see_memory import parse

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(_Tee(sys.stdout, buf)):
            call()
    finally:
        logger.removeHandler(handler)
    return parse(buf.getvalue())


class _Tee(io.TextIOBase):
    def __init__(self, *streams):
        self.streams = streams

    def write(self, s: str) -> int:
        for st in self.streams:
            st.write(s)
        return len(s)

    def flush(self) -> None:
        for st in self.streams:
            with contextlib.suppress(Exception):
                st.flush()


# --- one-time costs -------------------------------------------------------------------------------------


def op_cached(name: str) -> bool:
    """Whether torch's extensions cache already holds a build of this op (then jit_load only loads it)."""
    import glob
    import os

    from torch.utils.cpp_extension import _get_build_directory

    try:
        folder = _get_build_directory(name, verbose=False)
    except Exception:
        return False
    return bool(glob.glob(os.path.join(folder, "*.so")))


def folder_bytes(folder) -> int:
    from pathlib import Path

    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())
