"""Validation: every check that can fail before a rank is launched.

The schema (dsexp.core.schema) catches wrong types and unknown keys; `validate` checks what types cannot
express: tp against the GPUs present and the attention heads, the model folder, contradictory settings.
Each engine's and each trim's own rules (traits, version gate, what it refuses) come from its family member
(dsexp.engines, dsexp.trims).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Dict, Optional

from dsexp.core.checkpoint import checkpoint_problem, folder_config
from dsexp.core.schema import (
    DEVICES,
    DTYPES,
    FORMATS,
    LAUNCHERS,
    LOADERS,
    OFFLOADS,
    SCRIPT_PLACEHOLDERS,
    ConfigError,
    JobConfig,
    is_shared,
    placeholders,
)
from dsexp.core.workload import as_list
from dsexp.engines import ENGINES, traits
from dsexp.job.devices import visible_gpus
from dsexp.trims import TRIMS


def _one_of(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def resolve_device(spec: JobConfig, gpus: Optional[int] = None) -> str:
    gpus = visible_gpus() if gpus is None else gpus
    if spec.device == "auto":
        return "cuda" if gpus > 0 else "cpu"
    return spec.device


def model_dims(spec: JobConfig) -> Dict[str, Any]:
    """Architecture numbers: the local folder's config.json, a preset's dims, or (model=config) the built config's
    heads and sizes."""
    m = spec.model
    if m.path:
        return folder_config(Path(m.path))
    if m.config_path or not _is_preset(m.arch):
        from dsexp.models.presets import config_summary, make_config

        cfg = make_config(m.arch, dict(m.dims), m.dtype, m.config_path, m.trust_remote_code)
        return {k: v for k, v in config_summary(cfg).items() if v is not None}
    return dict(m.dims)


def _is_preset(arch: Optional[str]) -> bool:
    from dsexp.models.presets import ARCHS

    return arch in ARCHS


def validate(spec: JobConfig, gpus: Optional[int] = None, gpu_total: Optional[int] = None) -> JobConfig:
    """Raise ConfigError for any setting that cannot work; return spec with `device` resolved.

    gpus, gpu_total: the visible GPUs and the first one's bytes (None: asked of NVML)."""
    gpus = visible_gpus() if gpus is None else gpus
    _validate_settings(spec)
    device = resolve_device(spec, gpus)
    if device == "cuda" and gpus == 0:
        raise ConfigError("device=cuda but no GPU is visible (NVML found none)")
    _validate_gpus(spec, device, gpus)
    spec.device = device
    if spec.workload == "script":
        _validate_script(spec)
    else:
        _validate_pipeline(spec, device)
    if spec.shared_gpu and spec.workload == "pipeline":
        _validate_shared_fit(spec, gpu_total)
    if spec.budget.active:
        _validate_budget(spec, gpus, gpu_total)
    return spec


def _validate_settings(spec: JobConfig) -> None:
    """What the config says of itself, whatever machine it is for."""
    _one_of("device", spec.device, DEVICES)
    if spec.dtype in ("int8", "int4", "fp8", "float8", "uint8"):
        from dsexp.quant.check import DEAD_INT8_PATH, QUANT_INSTEAD

        raise ConfigError(
            f"dtype={spec.dtype}: the run dtype is fp32, bf16 or fp16; DeepSpeed's init_inference(dtype=torch.int8) "
            f"is the seed-era way to ask for it and DeepSpeed 0.19 rejects it ({DEAD_INT8_PATH}). Quantize with "
            f"{QUANT_INSTEAD}"
        )
    _one_of("dtype", spec.dtype, DTYPES)
    _one_of("model.dtype", spec.model.dtype, DTYPES)
    _one_of("load.name", spec.load.name, LOADERS)
    _one_of("load.format", spec.load.format, FORMATS)
    _one_of("engine.name", spec.engine.name, tuple(ENGINES))
    _one_of("launcher.name", spec.launcher.name, LAUNCHERS)
    _one_of("zero.offload", spec.zero.offload, OFFLOADS)
    _one_of("zero.stage", spec.zero.stage, (0, 1, 2, 3))
    if spec.tp < 1:
        raise ConfigError(f"tp={spec.tp}: tp must be >= 1")
    if spec.launcher.nodes < 1:
        raise ConfigError(f"launcher.nodes={spec.launcher.nodes}: must be >= 1")
    validate_nodes(spec)
    if not (0 < spec.probe.sample_ms <= 20 or spec.probe.sample_ms == 0):
        raise ConfigError(
            f"probe.sample_ms={spec.probe.sample_ms}: the sampler period must be in (0, 20] ms, "
            "or 0 to turn the background sampler off (peaks are then the phase-end readings only)"
        )
    _validate_generate(spec)
    if spec.timeout_s <= 0:
        raise ConfigError(f"timeout_s={spec.timeout_s}: must be > 0")


def validate_plan(spec: JobConfig) -> JobConfig:
    """The checks a plan (dsexp.plan) needs: the config's own sense, not this machine's. No GPU need be here (device
    auto is a GPU: the plan is for one), a local model folder need hold only config.json (and the code it names),
    and a budget's numbers are the GPUs planned for, not the ones present."""
    _validate_settings(spec)
    spec.device = "cpu" if spec.device == "cpu" else "cuda"
    if spec.workload == "script":
        _validate_script(spec)
    else:
        _validate_pipeline(spec, spec.device, weights=False)
    b = spec.budget
    if b.gpu_gib is not None and b.gpu_gib <= 0:
        raise ConfigError(f"budget.gpu_gib={b.gpu_gib}: must be > 0")
    return spec


def _validate_pipeline(spec: JobConfig, device: str, weights: bool = True) -> None:
    """dsexp's own pipeline: the model, the loading, the engine and its ZeRO block, the trims, the stack's versions."""
    if spec.zero.offload != "none" and spec.zero.stage != 3:
        raise ConfigError(
            f"zero.offload={spec.zero.offload} needs zero.stage=3 (DeepSpeed offloads parameters only "
            f"in stage 3), got zero.stage={spec.zero.stage}; set zero.stage=3 or zero.offload=none"
        )
    _validate_snapshot(spec, device)
    if device == "cpu" and spec.dtype == "fp16":
        raise ConfigError(
            "dtype=fp16 on device=cpu: DeepSpeed's CPU accelerator supports fp32 and bf16 only here; "
            "choose dtype=bf16 or dtype=fp32"
        )
    _validate_load(spec)
    _validate_injection_policy(spec)
    engine = traits(spec.engine.name)
    if engine.zero3 and spec.zero.stage != 3:
        raise ConfigError(
            f"engine={spec.engine.name} runs ZeRO stage 3 but zero={spec.zero.name} has stage "
            f"{spec.zero.stage}; choose zero=stage3, zero=stage3_offload or zero=seed_accepted"
        )
    _validate_model(spec, weights=weights)
    _validate_context(spec)
    _validate_stack(spec)
    engine.check(spec)
    for trim in TRIMS.values():
        trim.check(spec)
    _validate_trim_targets(spec)
    problem = engine.device_problem(spec, device)
    if problem:
        raise ConfigError(problem)
    _validate_quant(spec, device)


def _validate_quant(spec: JobConfig, device: str, capability: Any = "ask") -> None:
    """The quant member and KV cache against the device (and its compute capability), the engine, the model."""
    if not spec.quant.active:
        return
    from dsexp.engines.base import effective_policy
    from dsexp.job.devices import gpu_capability
    from dsexp.quant.check import problems

    engine, e = traits(spec.engine.name), spec.engine
    policy = effective_policy(e.injection_policy, e.kernel_inject, spec.model.injection_policy)
    # AutoTP's linears replace nn.Linear at tp > 1, and at tp=1 under a policy (DeepSpeed applies it then too)
    autotp = engine.inference_autotp and not e.kernel_inject and (spec.tp > 1 or policy is not None)
    if capability == "ask" and spec.budget.gpu_capability:  # the budget's GPUs (gpu=<card>), not the one here
        capability = _capability(spec.budget.gpu_capability)
    cap = (gpu_capability() if device == "cuda" else None) if capability == "ask" else capability
    dims = model_dims(spec) if spec.quant.kv is not None else {}
    found = problems(spec, device, cap, autotp, dims)
    if found:
        raise ConfigError("; ".join(found))
    _validate_quant_targets(spec)


def _capability(text: str) -> tuple:
    """budget.gpu_capability ("8.9") as (8, 9)."""
    parts = str(text).split(".")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ConfigError(f"budget.gpu_capability={text!r}: a compute capability is major.minor, as 8.9")
    return int(parts[0]), int(parts[1])


def _validate_quant_targets(spec: JobConfig) -> None:
    """A torchao member quantizes nn.Linear layers: a model without any (GPT-2's Conv1D) would run unquantized and be
    reported as the member (measured: model=tiny_gpt2 quant=int8_weight quantized 0 linears)."""
    from dsexp.quant import traits as quant_traits
    from dsexp.quant.placement import quantized_weights
    from dsexp.quant.torchao_rank import output_head

    t = quant_traits(spec.quant.name)
    model = _meta_model(spec) if t is not None and t.library == "torchao" else None
    if model is None or quantized_weights(model, t, spec.quant.head):
        return
    head = output_head(model)
    kinds = sorted({type(m).__name__ for m in model.modules() if m is not head and _is_matrix(m)})
    raise ConfigError(
        f"quant={t.key} with model={spec.model.name}: torchao's quantize_ takes nn.Linear layers and "
        f"{type(model).__name__} has none but its output head (its layers' weights are in {', '.join(kinds)}): it "
        "would run unquantized; use a model with nn.Linear layers, or quant.kv alone"
    )


def _meta_model(spec: JobConfig):
    """The job's model on the meta device, as the memory model builds it (None: one the meta device cannot build
    here; its ranks then say what it holds)."""
    from dataclasses import asdict

    from dsexp.predict import architecture as arch

    try:
        return arch.meta_model(arch.model_source(asdict(spec), None), spec.dtype)
    except Exception:
        return None


def _validate_trim_targets(spec: JobConfig) -> None:
    """trim.shard_embedding replaces an nn.Embedding by DeepSpeed's VocabParallelEmbedding (at tp > 1): a model whose
    input embedding is its own class (Gemma's scales the rows it looks up) failed in init."""
    import torch.nn as nn

    if not (spec.trim.shard_embedding and spec.tp > 1):
        return
    model = _meta_model(spec)
    emb = model.get_input_embeddings() if model is not None else None
    if emb is not None and type(emb) is not nn.Embedding:
        raise ConfigError(
            f"trim.shard_embedding with model={spec.model.name}: its input embedding is {type(emb).__name__}, not "
            "the nn.Embedding DeepSpeed's VocabParallelEmbedding replaces; set trim.shard_embedding=false (with "
            "trim=all the other trims still apply)"
        )


def _is_matrix(module) -> bool:
    """A module holding a 2-D weight other than an embedding table."""
    weight = getattr(module, "weight", None)
    return weight is not None and weight.dim() == 2 and not type(module).__name__.endswith("Embedding")


def _validate_script(spec: JobConfig) -> None:
    """A user's script: it exists (its path made absolute), its arguments are strings, its fixes are known; the
    model group only matters where an argument names {model_dir}."""
    if spec.quant.active:
        raise ConfigError(
            f"quant={spec.quant.name} (quant.kv={spec.quant.kv}) applies to dsexp's own pipeline; a script quantizes "
            "(or not) as it is written: leave quant unset with script.path"
        )
    s = spec.script
    path = Path(str(s.path)).expanduser()
    if not path.is_file():
        raise ConfigError(f"script.path={s.path!r} does not exist or is not a file (relative to {os.getcwd()})")
    s.path = str(path.resolve())
    bad = [(i, a) for i, a in enumerate(s.args) if isinstance(a, bool) or not isinstance(a, (str, int, float))]
    if bad:
        i, a = bad[0]
        raise ConfigError(
            f"script.args[{i}]={a!r}: each argument must be a string (Hydra read it as {type(a).__name__}; quote it: "
            f"\"script.args=[...,'{a}']\")"
        )
    s.args = [str(a) for a in s.args]
    _validate_script_args(spec)
    if s.max_new_tokens is not None and s.max_new_tokens < 1:
        raise ConfigError(f"script.max_new_tokens={s.max_new_tokens}: must be >= 1 (null: as the script asks)")
    from dsexp.core.remedies import fix_problem

    problem = fix_problem(list(s.fix), spec)
    if problem:
        raise ConfigError(problem)
    if spec.uses_model:
        _validate_model(spec, heads=False)  # the script's engine is not known before it runs


def _validate_script_args(spec: JobConfig) -> None:
    """The placeholders a script's arguments name are known and have one value each; a budget searches the batch
    through {batch_size}, so a budget on a script needs it."""
    named = placeholders(spec.script.args)
    unknown = [n for n in named if n not in SCRIPT_PLACEHOLDERS]
    if unknown:
        raise ConfigError(
            f"script.args: unknown placeholder {{{unknown[0]}}}; an argument may name "
            f"{', '.join('{' + n + '}' for n in SCRIPT_PLACEHOLDERS)}"
        )
    g = spec.generate
    for name, value in (("batch_size", g.batch_size), ("prompt_tokens", g.prompt_tokens)):
        if name in named and not isinstance(value, int):
            raise ConfigError(
                f"script.args names {{{name}}} but generate.{name}={value!r}: a script runs one "
                f"{name.replace('_', ' ')} a job; set generate.{name}=N (or sweep it: generate.{name}=1,8)"
            )
    if spec.budget.active and "batch_size" not in named:
        raise ConfigError(
            "a budget searches the batch, and a script takes its batch from its arguments: put {batch_size} in "
            "script.args where the script reads its batch size (e.g. \"script.args=[--batch-size,'{batch_size}']\"); "
            "dsexp fills it in for each run"
        )


def _validate_gpus(spec: JobConfig, device: str, gpus: int) -> None:
    """One GPU per rank, or (launcher.gpus) fewer GPUs that the ranks share: on this node's visible GPUs."""
    on_each, want = spec.ranks_per_node, spec.launcher.gpus
    if want is None:
        if device == "cuda" and on_each > gpus:
            raise ConfigError(
                f"tp={spec.tp} needs {on_each} GPUs per node but only {gpus} are visible; "
                f"allowed: tp <= {gpus * spec.launcher.nodes}, or launcher.gpus={gpus} to let the ranks share them"
            )
        return
    if want < 1:
        raise ConfigError(f"launcher.gpus={want}: must be >= 1 (null: one GPU per rank)")
    if device != "cuda":
        raise ConfigError(
            f"launcher.gpus={want} shares GPUs between ranks, but device={device}: leave launcher.gpus unset on CPU"
        )
    if want > gpus:
        raise ConfigError(f"launcher.gpus={want} but only {gpus} GPUs are visible; allowed: launcher.gpus <= {gpus}")
    if spec.launcher.pack:
        raise ConfigError(
            "launcher.pack=true gives each job GPUs of its own; with launcher.gpus the ranks share GPUs: "
            "set launcher.pack=false (or leave launcher.gpus unset)"
        )
    if not is_shared(want, on_each) or spec.workload == "script":  # a script's engine is seen only when it runs
        return
    why = traits(spec.engine.name).shared_gpu_problem(spec)
    if why:
        raise ConfigError(
            f"engine={spec.engine.name}{'+kernel_inject' if spec.engine.kernel_inject else ''} with ranks sharing a "
            f"GPU (launcher.gpus={want} < {on_each} ranks per node): {why}; give each rank a GPU (leave launcher.gpus "
            "unset)"
        )


def _validate_shared_fit(spec: JobConfig, gpu_total: Optional[int] = None) -> None:
    """Ranks sharing GPUs: refuse a job whose predicted memory on its busiest GPU exceeds that GPU (the memory model's
    weights and KV cache per rank, plus a CUDA context per process)."""
    from dsexp.compose.budget.model import predict_spec
    from dsexp.predict.fit import shared_gpu_fit

    total = gpu_total if gpu_total is not None else gpu_memory_total()
    if total is None:
        return
    try:
        pred = predict_spec(spec, device="cuda")
    except Exception:  # the model cannot predict it: the run will say
        return
    fit = shared_gpu_fit(pred, spec.ranks_per_node, int(spec.launcher.gpus), total)
    if not fit["fits"]:
        raise ConfigError(fit["message"])


GIB = 2**30


def _validate_budget(spec: JobConfig, gpus: int, gpu_total: Optional[int] = None) -> None:
    """A budget is sane and no larger than what is here to enforce it: its GPUs against the visible ones (one per
    rank), its GPU memory against a GPU's (times the ranks that share one), its host memory against the node's. Where
    the GPUs are elsewhere (a SLURM launcher) only its own numbers are checked. On a CPU run the device budget is
    simulated, so only the host's is compared with the machine."""
    b = spec.budget
    if b.gpus is None or b.gpu_gib is None:
        raise ConfigError(
            f"budget.gpus={b.gpus}, budget.gpu_gib={b.gpu_gib}: a budget names both the GPUs and the memory of each "
            "(e.g. budget.gpus=2 budget.gpu_gib=24)"
        )
    if b.gpus < 1 or b.gpu_gib <= 0 or (b.host_gib is not None and b.host_gib <= 0):
        raise ConfigError(
            f"budget.gpus={b.gpus}, budget.gpu_gib={b.gpu_gib}, budget.host_gib={b.host_gib}: must be > 0"
        )
    if b.batch_min < 1 or b.batch_step < 1 or b.batch_max < b.batch_min:
        raise ConfigError(
            f"budget.batch_min={b.batch_min}, budget.batch_max={b.batch_max}, budget.batch_step={b.batch_step}: "
            "need 1 <= batch_min <= batch_max and batch_step >= 1"
        )
    if b.confirm_margin_gib < 0:
        raise ConfigError(f"budget.confirm_margin_gib={b.confirm_margin_gib}: must be >= 0 (0: never confirm)")
    if b.host_gib is not None:
        import psutil

        host = psutil.virtual_memory().total
        if b.host_gib * GIB > host:
            raise ConfigError(f"budget.host_gib={b.host_gib} but this machine has {host / GIB:.1f} GiB of memory")
    if spec.device != "cuda":
        return
    if spec.launcher.gpus is None and b.gpus > gpus:
        raise ConfigError(
            f"budget.gpus={b.gpus} but only {gpus} GPUs are visible; allowed: budget.gpus <= {gpus}, or "
            f"launcher.gpus={gpus} to let the ranks share them (each rank stands in for one GPU of the budget)"
        )
    total = gpu_total if gpu_total is not None else gpu_memory_total()
    if total is None:
        return
    sharing = -(-spec.ranks_per_node // int(spec.launcher.gpus or spec.ranks_per_node))
    if sharing * b.gpu_gib * GIB > total:
        who = f"{sharing} ranks sharing one GPU x " if sharing > 1 else ""
        raise ConfigError(
            f"budget.gpu_gib={b.gpu_gib}: {who}{b.gpu_gib} GiB = {sharing * b.gpu_gib:.1f} GiB but the GPU has "
            f"{total / GIB:.1f} GiB; allowed: budget.gpu_gib <= {total / GIB / sharing:.1f}"
            + (" at this tp, or more GPUs (launcher.gpus)" if sharing > 1 else "")
        )


def gpu_memory_total() -> Optional[int]:
    """Bytes of the first visible GPU (NVML; CUDA_VISIBLE_DEVICES by index or UUID); None without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        first = (os.environ.get("CUDA_VISIBLE_DEVICES") or "0").split(",")[0].strip()
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        pynvml.nvmlShutdown()
        return total
    except Exception:
        return None


def _validate_snapshot(spec: JobConfig, device: str) -> None:
    """probe.memory_snapshot records PyTorch's CUDA caching allocator: there is none on a CPU run."""
    probe = spec.probe
    if not probe.memory_snapshot:
        return
    if device == "cpu":
        raise ConfigError(
            "probe.memory_snapshot=true on device=cpu: PyTorch memory snapshots record the CUDA caching allocator, "
            "which a CPU run does not use; the memory-over-time series (ranks/rank{N}.series.jsonl, trace.json) "
            "is recorded on every device; run on a GPU machine or set probe.memory_snapshot=false"
        )
    if probe.snapshot_max_entries < 1 or probe.snapshot_max_mb <= 0:
        raise ConfigError(
            f"probe.snapshot_max_entries={probe.snapshot_max_entries}, probe.snapshot_max_mb={probe.snapshot_max_mb}: "
            "both must be > 0"
        )


def _validate_load(spec: JobConfig) -> None:
    """meta and sharded hand the model to DeepSpeed's AutoTP on the meta device; other engines would not fill it."""
    name, engine = spec.load.name, spec.engine
    if name in ("meta", "sharded") and not traits(engine.name).fills_meta:
        fillers = "|".join(n for n, t in ENGINES.items() if t.fills_meta)
        raise ConfigError(
            f"load={name} needs engine={fillers} (it builds the model on the meta device and "
            f"relies on {fillers} to place it); engine={engine.name} would leave it empty"
        )
    if name == "sharded" and engine.kernel_inject:
        raise ConfigError(
            "load=sharded slices with AutoTP; engine.kernel_inject=true replaces the layers with "
            "DeepSpeed kernels whose tensors the split files do not hold; set engine.kernel_inject=false"
        )
    if name == "meta" and engine.kernel_inject and spec.load.format != "bin":
        raise ConfigError(
            "load=meta with engine.kernel_inject=true: DeepSpeed's kernel-injection checkpoint path "
            "reads files with torch.load only; set load.format=bin"
        )


def _validate_model(spec: JobConfig, heads: bool = True, weights: bool = True) -> None:
    """The model group's source, and (heads) tp against its key/value heads for the engine. weights=False (a plan):
    a local folder need hold only config.json, whose dimensions must all be there."""
    m = spec.model
    if m.path:
        folder = Path(m.path).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"model.path={m.path!r} does not exist or is not a folder")
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.path={m.path!r} has no config.json")
        files = [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
        if weights and not files:
            raise ConfigError(
                f"model.path={m.path!r} holds no weights (*.safetensors or *.bin); for a folder holding only "
                f"config.json use model=config model.config_path={m.path} (random weights at its shapes, written "
                f"once), the route python -m dsexp.plan takes too"
            )
        try:
            cfg = folder_config(folder)
        except (ValueError, OSError) as e:  # json's JSONDecodeError is a ValueError
            raise ConfigError(f"model.path={m.path!r}: config.json is not valid JSON ({e})") from None
        if not isinstance(cfg, dict):
            raise ConfigError(f"model.path={m.path!r}: config.json holds {type(cfg).__name__}, not an object")
        if cfg.get("auto_map") and not m.trust_remote_code:
            raise ConfigError(
                f"model.path={m.path!r} ships its own modeling code (auto_map in config.json); "
                "set model.trust_remote_code=true explicitly to allow running it"
            )
        problem = checkpoint_problem(folder) if files else config_problem(cfg)
        if problem:
            raise ConfigError(f"model.path={m.path!r}: {problem}")
    elif m.config_path:
        _validate_config_folder(m.config_path, m.trust_remote_code)
    elif not m.arch:
        raise ConfigError(
            f"model={m.name}: set model.path to a local folder, model.config_path to a folder holding a "
            "config.json, or model.arch to generate one"
        )
    else:
        from dsexp.models.presets import ARCHS, arch_problem, clashes

        problem = arch_problem(m.arch)
        if problem:
            raise ConfigError(f"model.arch={m.arch!r}: {problem}")
        if m.arch in ARCHS and ARCHS[m.arch].remote_code and not m.trust_remote_code:
            raise ConfigError(f"model.arch={m.arch} loads through remote code; set model.trust_remote_code=true")
        for key in clashes(m.arch, dict(m.dims)):
            raise ConfigError(
                f"model.dims.{key}={m.dims[key]!r} clashes with the preset model.arch={m.arch}, which sets {key} "
                f"itself: drop it from model.dims (the dtype is model.dtype), or write a config.json with it and use "
                f"model.config_path"
            )
    try:
        dims = model_dims(spec)
    except Exception as e:  # transformers refused the dims (inconsistent sizes, a broken config folder)
        where = f"model.config_path={m.config_path!r}" if m.config_path else f"model.arch={m.arch!r}"
        raise ConfigError(
            f"model={m.name}: transformers cannot build a config from {where} and model.dims={dict(m.dims)}: "
            f"{type(e).__name__}: {e}"
        ) from e
    if not heads:
        return
    kv = dims.get("num_key_value_heads") or dims.get("num_attention_heads")
    engine = traits(spec.engine.name)
    if kv and spec.tp > int(kv) and engine.splits_weights:
        raise ConfigError(
            f"tp={spec.tp} leaves some ranks with no attention heads: the model has "
            f"{kv} key/value heads; allowed: tp <= {kv}"
        )
    if kv and int(kv) % spec.tp and engine.even_heads:
        # DeepSpeed's AutoTP (init_inference) splits unevenly by whole KV heads; these split rows evenly.
        raise ConfigError(
            f"engine={spec.engine.name} splits attention evenly: tp={spec.tp} must divide the "
            f"model's {kv} key/value heads"
        )


# The dimensions the memory model reads of any config (transformers' names; an architecture's own aliases, such as
# GPT-2's n_embd, are read through its config class's attribute_map)
NEEDED_DIMS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def config_problem(cfg: Dict[str, Any]) -> Optional[str]:
    """What keeps a config.json alone (no weights: a plan) from being predicted: a model_type transformers does not
    know and no code of its own (auto_map), or a dimension it leaves out (transformers would fill in its class's
    default, silently another model). None if nothing."""
    from dsexp.models.presets import transformers_model_types

    kind = cfg.get("model_type")
    types = transformers_model_types()
    aliases: Dict[str, set] = {}
    if not cfg.get("auto_map"):
        if kind not in types:
            import difflib

            close = difflib.get_close_matches(str(kind), sorted(types), n=5, cutoff=0.6)
            return (
                f"config.json's model_type={kind!r} is not one of transformers' {len(types)} model types"
                + (f" (close: {', '.join(close)})" if close else "")
                + " and the folder ships no code of its own (auto_map)"
            )
        from transformers import AutoConfig

        mapping = getattr(AutoConfig.for_model(kind), "attribute_map", {}) or {}
        for alias, name in mapping.items():
            aliases.setdefault(name, set()).add(alias)
    text = cfg.get("text_config") if isinstance(cfg.get("text_config"), dict) else {}
    for name in NEEDED_DIMS:
        keys = {name} | aliases.get(name, set())
        if not any(k in cfg or k in text for k in keys):
            return (
                f"config.json (model_type={kind!r}) has no {' / '.join(sorted(keys))}: the memory model needs "
                f"{', '.join(NEEDED_DIMS)} (transformers would take its class's default, another model)"
            )
    return None


def _validate_generate(spec: JobConfig) -> None:
    """The workload's shape: whole numbers, a batch of at least 1, positive lengths, at least one timed repeat."""
    g = spec.generate
    for key, values, least in (
        ("generate.batch_size", as_list(g.batch_size), 1),
        ("generate.prompt_tokens", [] if g.prompt_tokens is None else as_list(g.prompt_tokens), 1),
        ("generate.new_tokens", [g.new_tokens], 1),
        ("generate.repeats", [g.repeats], 1),
        ("generate.warmup", [g.warmup], 0),
    ):
        if not values and key != "generate.prompt_tokens":
            raise ConfigError(f"{key}=[]: give at least one value")
        for v in values:
            if isinstance(v, bool) or not isinstance(v, int):
                raise ConfigError(f"{key}={v!r}: must be a whole number (or a list of them)")
            if v < least:
                raise ConfigError(f"{key}={v}: must be >= {least}")
    if g.prompt_tokens is not None and not as_list(g.prompt_tokens):
        raise ConfigError("generate.prompt_tokens=[]: give at least one length, or null for the prompt text")
    if g.bisect_from is not None:
        _validate_bisect(spec)


def _validate_bisect(spec: JobConfig) -> None:
    """A batch search inside one load: a whole number among a list of batches, one prompt length, dsexp's own
    workload (a script's batch is its argument: one a job)."""
    g = spec.generate
    if isinstance(g.bisect_from, bool) or not isinstance(g.bisect_from, int):
        raise ConfigError(f"generate.bisect_from={g.bisect_from!r}: must be a whole number (a batch of the list)")
    if g.bisect_from not in as_list(g.batch_size):
        raise ConfigError(
            f"generate.bisect_from={g.bisect_from}: not among generate.batch_size={as_list(g.batch_size)} "
            "(the batches it searches)"
        )
    if len(as_list(g.prompt_tokens)) != 1:
        raise ConfigError(
            f"generate.bisect_from with generate.prompt_tokens={g.prompt_tokens}: a batch search holds one prompt "
            "length"
        )
    if spec.workload == "script":
        raise ConfigError(
            "generate.bisect_from: a script's batch is its argument, one a job; a budget search runs it batch by batch"
        )


def _validate_context(spec: JobConfig) -> None:
    """The longest prompt plus the new tokens against the model's max_position_embeddings (where it has one)."""
    lengths = [n for n in as_list(spec.generate.prompt_tokens) if n is not None]
    if not lengths:
        return
    total = max(lengths) + spec.generate.new_tokens
    if spec.engine.kernel_inject and total > spec.engine.max_out_tokens:
        raise ConfigError(
            f"generate.prompt_tokens={max(lengths)} + generate.new_tokens={spec.generate.new_tokens} = {total} "
            f"tokens, past engine.max_out_tokens={spec.engine.max_out_tokens}: kernel injection's workspace holds "
            "that many (past it DeepSpeed gives wrong output or an illegal memory access, #2485, #4506); raise "
            "engine.max_out_tokens"
        )
    limit = model_dims(spec).get("max_position_embeddings")
    if limit and total > int(limit):
        raise ConfigError(
            f"generate.prompt_tokens={max(lengths)} + generate.new_tokens={spec.generate.new_tokens} = {total} "
            f"tokens, past model={spec.model.name}'s max_position_embeddings={limit}; shorten the prompt or the "
            f"output, or raise model.dims.max_position_embeddings"
        )


def _validate_config_folder(config_path: str, trust_remote_code: bool) -> None:
    folder = Path(config_path).expanduser()
    if not folder.is_dir():
        raise ConfigError(f"model.config_path={config_path!r} does not exist or is not a folder")
    if not (folder / "config.json").is_file():
        raise ConfigError(
            f"model.config_path={config_path!r} has no config.json (a config folder holds config.json and "
            "optionally the modeling code it maps to)"
        )
    try:
        cfg = folder_config(folder)
    except ValueError as e:
        raise ConfigError(f"model.config_path={config_path!r}: config.json is not valid JSON ({e})") from e
    if cfg.get("auto_map") and not trust_remote_code:
        raise ConfigError(
            f"model.config_path={config_path!r} maps its classes to shipped code (auto_map in config.json); "
            "set model.trust_remote_code=true explicitly to allow running it"
        )
    if not cfg.get("auto_map") and not cfg.get("model_type"):
        raise ConfigError(f"model.config_path={config_path!r}: config.json has neither model_type nor auto_map")


def _validate_injection_policy(spec: JobConfig) -> None:
    p = spec.engine.injection_policy
    if isinstance(p, str) and p not in ("auto", "infer"):
        raise ConfigError(
            f"engine.injection_policy={p!r} is not allowed; choose auto (the model preset's policy), infer "
            "(dsexp's: known layouts, then DeepSpeed's parser, then the module structure), null (DeepSpeed's "
            "parser) or {LayerClass: [row-parallel linears]}"
        )
    if p is not None and not isinstance(p, (str, dict)) and not hasattr(p, "items"):
        raise ConfigError(f"engine.injection_policy={p!r}: expected auto, infer, null or {{LayerClass: [linears]}}")


def _validate_stack(spec: JobConfig) -> None:
    """A stack's pins against what the engine and the trims need (their version gates; the pins themselves are
    checked when the stack is prepared, before any job: dsexp.job.overlay)."""
    gates = [(f"engine={spec.engine.name}", traits(spec.engine.name).gate)]
    gates += [(f"trim.{key}=true", t.gate) for key, t in TRIMS.items() if t.gate and getattr(spec.trim, key)]
    for who, gate in gates:
        problem = gate.problem(who, spec.stack) if gate else None
        if problem:
            raise ConfigError(problem)


def validate_nodes(spec: JobConfig) -> None:
    nodes = spec.launcher.nodes
    if nodes > 1 and spec.launcher.pack:
        raise ConfigError(
            f"launcher.pack=true shares out the GPUs of this machine; a job over launcher.nodes={nodes} "
            "nodes gets its nodes from the cluster: set launcher.pack=false"
        )
    if nodes > 1 and spec.tp % nodes:
        raise ConfigError(
            f"tp={spec.tp} does not split evenly over launcher.nodes={nodes}; choose tp as a multiple of {nodes}"
        )
    if spec.launcher.hostfile and spec.launcher.name != "deepspeed":
        raise ConfigError(
            f"launcher.hostfile is read by the DeepSpeed launcher only; with launcher={spec.launcher.name} "
            "the nodes come from the SLURM allocation (set launcher=deepspeed to use a hostfile)"
        )
    if spec.launcher.hostfile and not Path(spec.launcher.hostfile).expanduser().is_file():
        raise ConfigError(f"launcher.hostfile={spec.launcher.hostfile!r} does not exist")
