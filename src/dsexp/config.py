"""Structured config schema and validation: every check that can fail before a rank is launched.

The YAML groups in `conf/` are merged onto these dataclasses, so a wrong type or an unknown key is
reported with its full dotted name. `validate` then checks what types cannot express (tp against
the GPUs present and the attention heads, the model folder, contradictory settings).
"""
from __future__ import annotations

import json
import os
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from omegaconf import MISSING, DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

DTYPES = ("fp32", "bf16", "fp16")
DEVICES = ("auto", "cpu", "cuda")


class ConfigError(ValueError):
    """A bad setting, reported before anything is launched. The message names the key."""


@dataclass
class ModelConfig:
    name: str = MISSING
    arch: Optional[str] = "llama"
    path: Optional[str] = None
    dtype: str = "bf16"
    trust_remote_code: bool = False
    shard_mb: float = 100
    seed: int = 0
    injection_policy: Optional[Dict[str, List[str]]] = None
    dims: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LoadConfig:
    name: str = "eager"
    format: str = "safetensors"
    shard_dir: Optional[str] = None   # sharded: where split checkpoints are cached (null: <cache_dir>/shards)
    restore_buffers: bool = True      # put back non-persistent buffers (RoPE) the engine cast or left empty


@dataclass
class EngineConfig:
    name: str = "init_inference"
    kernel_inject: bool = False
    injection_policy: Any = "auto"
    max_out_tokens: int = 1024
    replace_method: Optional[str] = None
    keep_module_on_host: bool = False


@dataclass
class ZeroConfig:
    name: str = "none"
    stage: int = 0
    offload: str = "none"
    extra: Dict[str, Any] = field(default_factory=dict)


@dataclass
class LauncherConfig:
    name: str = "torchrun"
    grace_s: float = 10.0
    pack: bool = False
    nodes: int = 1
    hostfile: Optional[str] = None


@dataclass
class GenerateConfig:
    prompt: str = "what is deepspeed?"
    new_tokens: int = 16


@dataclass
class ProbeConfig:
    sample_ms: float = 10.0
    see_memory_usage: bool = True
    nvidia_smi: bool = False


@dataclass
class CheckConfig:
    correctness: bool = True
    rel_err_tol: Optional[float] = None


@dataclass
class TrackingConfig:
    uri: Optional[str] = None
    experiment: str = "dsexp"


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    load: LoadConfig = field(default_factory=LoadConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)
    generate: GenerateConfig = field(default_factory=GenerateConfig)
    probe: ProbeConfig = field(default_factory=ProbeConfig)
    check: CheckConfig = field(default_factory=CheckConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    tp: int = 1
    dtype: str = "bf16"
    device: str = "auto"
    variant: Optional[str] = None
    cache_dir: str = "~/.cache/dsexp"
    timeout_s: float = 900.0
    rerun: bool = False
    fault: Optional[Dict[str, Any]] = None


# Option names each group accepts (the YAML files in conf/ are the source; engines/loaders register here too).
LOADERS = ("eager", "meta", "sharded")
ENGINES = ("init_inference", "zero_inference", "autotp_zero3", "hf_tp")
LAUNCHERS = ("torchrun", "deepspeed")
FORMATS = ("safetensors", "bin")
OFFLOADS = ("none", "cpu")
ZERO3_ENGINES = ("zero_inference", "autotp_zero3")  # engines built on deepspeed.initialize with ZeRO stage 3


def to_schema(cfg: DictConfig) -> JobConfig:
    """Merge a composed config onto the schema; type errors and unknown keys name the key."""
    plain = OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), plain)
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"config key '{key}': {getattr(e, 'msg', e)}") from None


def _one_of(key: str, value: Any, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not allowed; choose one of: {', '.join(map(str, allowed))}")


def visible_gpus() -> int:
    """GPUs this process may use (NVML, narrowed by CUDA_VISIBLE_DEVICES); 0 without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        pynvml.nvmlShutdown()
    except Exception:
        return 0
    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    if vis is not None:
        n = min(n, len([v for v in vis.split(",") if v.strip() not in ("", "-1")]))
    return n


def resolve_device(spec: JobConfig, gpus: Optional[int] = None) -> str:
    gpus = visible_gpus() if gpus is None else gpus
    if spec.device == "auto":
        return "cuda" if gpus > 0 else "cpu"
    return spec.device


def model_dims(spec: JobConfig) -> Dict[str, Any]:
    """Architecture numbers: the preset's dims, or the local folder's config.json."""
    if spec.model.path:
        cfg_file = Path(spec.model.path).expanduser() / "config.json"
        with open(cfg_file) as f:
            return json.load(f)
    return dict(spec.model.dims)


def validate(spec: JobConfig, gpus: Optional[int] = None) -> JobConfig:
    """Raise ConfigError for any setting that cannot work; return spec with `device` resolved."""
    gpus = visible_gpus() if gpus is None else gpus
    _one_of("device", spec.device, DEVICES)
    _one_of("dtype", spec.dtype, DTYPES)
    _one_of("model.dtype", spec.model.dtype, DTYPES)
    _one_of("load.name", spec.load.name, LOADERS)
    _one_of("load.format", spec.load.format, FORMATS)
    _one_of("engine.name", spec.engine.name, ENGINES)
    _one_of("launcher.name", spec.launcher.name, LAUNCHERS)
    _one_of("zero.offload", spec.zero.offload, OFFLOADS)
    _one_of("zero.stage", spec.zero.stage, (0, 1, 2, 3))
    if spec.tp < 1:
        raise ConfigError(f"tp={spec.tp}: tp must be >= 1")
    if spec.launcher.nodes < 1:
        raise ConfigError(f"launcher.nodes={spec.launcher.nodes}: must be >= 1")
    from dsexp.multinode import per_node, validate_nodes  # here, not at the top: multinode imports this module

    validate_nodes(spec)
    if not (0 < spec.probe.sample_ms <= 20 or spec.probe.sample_ms == 0):
        raise ConfigError(f"probe.sample_ms={spec.probe.sample_ms}: the sampler period must be in (0, 20] ms, "
                          "or 0 to turn the background sampler off (peaks are then the phase-end readings only)")
    if spec.generate.new_tokens < 1:
        raise ConfigError(f"generate.new_tokens={spec.generate.new_tokens}: must be >= 1")
    if spec.timeout_s <= 0:
        raise ConfigError(f"timeout_s={spec.timeout_s}: must be > 0")

    device = resolve_device(spec, gpus)
    if device == "cuda" and gpus == 0:
        raise ConfigError("device=cuda but no GPU is visible (NVML found none)")
    on_each = per_node(spec.tp, spec.launcher.nodes)
    if device == "cuda" and on_each > gpus:
        raise ConfigError(f"tp={spec.tp} needs {on_each} GPUs per node but only {gpus} are visible; "
                          f"allowed: tp <= {gpus * spec.launcher.nodes}")
    if spec.zero.offload != "none" and spec.zero.stage != 3:
        raise ConfigError(f"zero.offload={spec.zero.offload} needs zero.stage=3 (DeepSpeed offloads parameters only "
                          f"in stage 3), got zero.stage={spec.zero.stage}; set zero.stage=3 or zero.offload=none")
    if device == "cpu" and spec.dtype == "fp16":
        raise ConfigError("dtype=fp16 on device=cpu: DeepSpeed's CPU accelerator supports fp32 and bf16 only here; "
                          "choose dtype=bf16 or dtype=fp32")

    _validate_load(spec)
    if spec.engine.name in ZERO3_ENGINES and spec.zero.stage != 3:
        raise ConfigError(f"engine={spec.engine.name} runs ZeRO stage 3 but zero={spec.zero.name} has stage "
                          f"{spec.zero.stage}; choose zero=stage3, zero=stage3_offload or zero=seed_accepted")
    _validate_model(spec)
    if device == "cpu" and spec.engine.name == "init_inference" and spec.engine.kernel_inject:
        layers = _kernel_injected_layers(spec)
        if layers:
            raise ConfigError(f"engine.kernel_inject=true on device=cpu: DeepSpeed's kernel injection would replace "
                              f"{', '.join(layers)} of model={spec.model.name} with CUDA kernels; "
                              "set engine.kernel_inject=false or run on a GPU machine")
    spec.device = device
    return spec


def _validate_load(spec: JobConfig) -> None:
    """meta and sharded hand the model to DeepSpeed's AutoTP on the meta device; other engines would not fill it."""
    name, engine = spec.load.name, spec.engine
    if name in ("meta", "sharded") and engine.name != "init_inference":
        raise ConfigError(f"load={name} needs engine=init_inference (it builds the model on the meta device and "
                          f"relies on init_inference to place it); engine={engine.name} would leave it empty")
    if name == "sharded" and engine.kernel_inject:
        raise ConfigError("load=sharded slices with AutoTP; engine.kernel_inject=true replaces the layers with "
                          "DeepSpeed kernels whose tensors the split files do not hold; set engine.kernel_inject=false")
    if name == "meta" and engine.kernel_inject and spec.load.format != "bin":
        raise ConfigError("load=meta with engine.kernel_inject=true: DeepSpeed's kernel-injection checkpoint path "
                          "reads files with torch.load only; set load.format=bin")


def _kernel_injected_layers(spec: JobConfig):
    """Layer classes DeepSpeed has a kernel policy for (none: kernel injection is a no-op, runnable on CPU)."""
    from dsexp.engines.kernel_policy import folder_kernel_injected_layers, preset_kernel_injected_layers

    m = spec.model
    if m.path:
        return folder_kernel_injected_layers(str(Path(m.path).expanduser()), m.trust_remote_code)
    return preset_kernel_injected_layers(m.arch, json.dumps(dict(m.dims), sort_keys=True), m.dtype)


def _validate_model(spec: JobConfig) -> None:
    m = spec.model
    if m.path:
        folder = Path(m.path).expanduser()
        if not folder.is_dir():
            raise ConfigError(f"model.path={m.path!r} does not exist or is not a folder")
        if not (folder / "config.json").is_file():
            raise ConfigError(f"model.path={m.path!r} has no config.json")
        weights = [p for p in folder.iterdir() if p.suffix in (".safetensors", ".bin")]
        if not weights:
            raise ConfigError(f"model.path={m.path!r} holds no weights (*.safetensors or *.bin)")
        cfg = json.loads((folder / "config.json").read_text())
        if cfg.get("auto_map") and not m.trust_remote_code:
            raise ConfigError(f"model.path={m.path!r} ships its own modeling code (auto_map in config.json); "
                              "set model.trust_remote_code=true explicitly to allow running it")
        problem = checkpoint_problem(folder)
        if problem:
            raise ConfigError(f"model.path={m.path!r}: {problem}")
    elif not m.arch:
        raise ConfigError(f"model={m.name}: set model.path to a local folder or model.arch to generate one")
    else:
        from dsexp.models.presets import ARCHS

        _one_of("model.arch", m.arch, tuple(ARCHS))
        if m.arch in ARCHS and ARCHS[m.arch].remote_code and not m.trust_remote_code:
            raise ConfigError(f"model.arch={m.arch} loads through remote code; set model.trust_remote_code=true")
    dims = model_dims(spec)
    kv = dims.get("num_key_value_heads") or dims.get("num_attention_heads")
    if kv and spec.tp > int(kv) and spec.engine.name in ("init_inference", "autotp_zero3", "hf_tp"):
        raise ConfigError(f"tp={spec.tp} leaves some ranks with no attention heads: the model has "
                          f"{kv} key/value heads; allowed: tp <= {kv}")
    if kv and int(kv) % spec.tp and spec.engine.name in ("autotp_zero3", "hf_tp"):
        # DeepSpeed's AutoTP (init_inference) splits unevenly by whole KV heads; these split rows evenly.
        raise ConfigError(f"engine={spec.engine.name} splits attention evenly: tp={spec.tp} must divide the "
                          f"model's {kv} key/value heads")


def checkpoint_problem(folder: Path) -> Optional[str]:
    """Cheap integrity check of a checkpoint folder (headers and sizes only, no tensor data is read): shards the
    index names but that are missing, safetensors files whose header is unreadable or whose size disagrees with
    it (truncated), and zip-format .bin files with no zip directory. None if nothing is wrong."""
    folder = Path(folder)
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{index.name} is unreadable ({type(e).__name__}: {e})"
        missing = sorted(f for f in shards if not (folder / f).is_file())
        if missing:
            return f"{index.name} names shards that are missing: {', '.join(missing)}"
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path.name} {problem}"
    for path in sorted(folder.glob("*.bin")):
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"
        if zipped and not zipfile.is_zipfile(path):
            return f"{path.name} is truncated or corrupt (a zip-format torch checkpoint without its zip directory)"
    return None


def _safetensors_problem(path: Path) -> Optional[str]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated or empty ({size} bytes, no safetensors header)"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"is truncated or corrupt (header length {n} > file size {size})"
        try:
            header = json.loads(f.read(n))
            end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] + [0])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"has a corrupt safetensors header ({type(e).__name__})"
    if 8 + n + end != size:
        return (f"is truncated ({size} bytes, its header describes {8 + n + end})" if size < 8 + n + end else
                f"is corrupt ({size} bytes, its header describes {8 + n + end})")
    return None
