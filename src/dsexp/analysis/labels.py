"""A configuration's short name, as the matrix, MLflow's run names and the sweep's summary show it: everything but tp
(model, load, engine, ZeRO, dtype, the trims' short names, a shared GPU, the software stack), or a user's script with
its arguments and fixes."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Dict, Optional

from dsexp import quant, trims
from dsexp.core.schema import fill_args, stack_label


def config_label(config: Dict[str, Any], workload: bool = True) -> str:
    """A configuration's short name, everything but tp: variant/model/load/engine/zero/dtype/trims (what is set),
    and `@stack` when the ranks ran on a software stack other than the job's own environment. A load that keeps
    the buffers as loaded (load.restore_buffers=false) is marked `+buffers_as_loaded`."""
    if (config.get("script") or {}).get("path"):
        return script_label(config)
    model, load, eng, zero = (config.get(k) or {} for k in ("model", "load", "engine", "zero"))
    dtype, mdtype = config.get("dtype") or model.get("dtype"), model.get("dtype")
    stack = stack_label(config.get("stack") or {})
    parts = [
        config.get("variant"),
        model_label(model),
        (load.get("name") or "eager")
        + ("-bin" if load.get("format") == "bin" else "")
        + ("+buffers_as_loaded" if load.get("restore_buffers") is False else ""),
        (eng.get("name") or "") + ("+inject" if eng.get("kernel_inject") else ""),
        None if (zero.get("name") or "none") == "none" else f"zero-{zero.get('name')}",
        f"{dtype}<-{mdtype}" if mdtype and dtype != mdtype else dtype,
        trims.label(config.get("trim")),
        quant.label(config.get("quant")),
        shared_gpu_label(config),
        workload_label(config) if workload else None,
    ]
    return "/".join(str(p) for p in parts if p) + ("" if stack == "current" else f"@{stack}")


def workload_label(config: Dict[str, Any]) -> Optional[str]:
    """The workload's shape where it is not the default prompt at batch 1: `b8xL2048`, a grid `b[1,8]xL[512,2048]`,
    a batch search over 1 to 7 `b1..7?xL2048` (two shapes are two configurations of the matrix; the capacity report
    groups them with workload=False)."""
    g = config.get("generate") or {}
    batch, length = g.get("batch_size", 1), g.get("prompt_tokens")
    if batch in (None, 1) and length is None:
        return None

    def show(v: Any) -> str:
        return "[" + ",".join(map(str, v)) + "]" if isinstance(v, (list, tuple)) else str(v)

    if g.get("bisect_from") is not None:  # a batch search inside one load: its range, `b1..7?`
        batches = sorted(batch) if isinstance(batch, (list, tuple)) else [batch]
        return f"b{batches[0]}..{batches[-1]}?" + ("" if length is None else f"xL{show(length)}")
    return f"b{show(batch or 1)}" + ("" if length is None else f"xL{show(length)}")


def script_label(config: Dict[str, Any]) -> str:
    """A user's script's configuration: variant/script:<file> <args>/model (when {model_dir} is used)/fix=.../
    cap/launcher (other than torchrun)/shared_gpu, and `@stack`. Its arguments are part of it (two argument lists
    never share a row), their placeholders filled in ({batch_size}: each batch its own row)."""
    s = config["script"]
    model = config.get("model") or {}
    gen = config.get("generate") or {}
    values = {
        "model_dir": f"<{model.get('name')}>",
        **{k: gen.get(k) for k in ("batch_size", "prompt_tokens", "new_tokens")},
    }
    args = " ".join(fill_args(list(s.get("args") or []), values))
    if len(args) > 48:
        args = args[:40] + "~" + hashlib.sha1(args.encode()).hexdigest()[:6]
    uses_model = any("{model_dir}" in str(a) for a in s.get("args") or [])
    launcher = (config.get("launcher") or {}).get("name") or ""
    parts = [
        config.get("variant"),
        f"script:{Path(s['path']).name}" + (f" {args}" if args else ""),
        model_label(model) if uses_model else None,
        f"fix={'+'.join(s['fix'])}" if s.get("fix") else None,
        f"max_new_tokens<={s['max_new_tokens']}" if s.get("max_new_tokens") else None,
        # a script runs under the launcher its user names (the DeepSpeed one passes --local_rank): two launchers,
        # two configurations
        None if launcher in ("", "torchrun") else f"launcher={launcher}",
        shared_gpu_label(config),
    ]
    stack = stack_label(config.get("stack") or {})
    return "/".join(str(p) for p in parts if p) + ("" if stack == "current" else f"@{stack}")


def shared_gpu_label(config: Dict[str, Any]) -> Optional[str]:
    """`shared_gpu` (or `shared_<n>gpu`) for a GPU run whose ranks share launcher.gpus GPUs per node: its speed is
    gloo's on shared GPUs, so it is never the same row as a run with a GPU per rank."""
    gpus = (config.get("launcher") or {}).get("gpus")
    if gpus is None or config.get("device") == "cpu":
        return None
    return "shared_gpu" if int(gpus) == 1 else f"shared_{gpus}gpu"


def model_label(model: Dict[str, Any]) -> Optional[str]:
    """The model's name; for a user's folder or a config-only model, which one (folder name or architecture)."""
    name = model.get("name")
    source = model.get("path") or model.get("config_path")
    if name in ("local", "config") and (source or model.get("arch")):
        return f"{name}:{Path(source).name if source else model['arch']}"
    return name
