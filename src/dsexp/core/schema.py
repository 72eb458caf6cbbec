"""The job schema: one dataclass per config group, and `from_dict` to rebuild it from plain data.

The YAML groups in `conf/` are merged onto these dataclasses by `dsexp.compose` (OmegaConf), so a wrong
type or an unknown key is reported with its full dotted name. The ranks read the resolved config from
`job.json` with `from_dict`, without OmegaConf. `"???"` is OmegaConf's mark for a required value.
"""

from __future__ import annotations

import dataclasses
import re
import typing
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

DTYPES = ("fp32", "bf16", "fp16")
TORCH_DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # torch.<name> of each
DEVICES = ("auto", "cpu", "cuda")
LOADERS = ("eager", "meta", "sharded")
LAUNCHERS = ("torchrun", "deepspeed")
FORMATS = ("safetensors", "bin")
OFFLOADS = ("none", "cpu")
REQUIRED = "???"


class ConfigError(ValueError):
    """A bad setting, reported before anything is launched. The message names the key."""


@dataclass
class ModelConfig:
    name: str = REQUIRED
    arch: Optional[str] = "llama"  # a dsexp preset or any transformers model_type (model=config)
    path: Optional[str] = None  # a local HF folder instead of a generated checkpoint
    config_path: Optional[str] = None  # a folder holding config.json (+ remote code): random weights at its shapes
    dtype: str = "bf16"  # the checkpoint's dtype on disk
    trust_remote_code: bool = False  # set explicitly where config.json maps classes to shipped code (auto_map)
    shard_mb: float = 100  # checkpoint shard size written
    seed: int = 0  # random weights' seed
    # {layer class: [row-parallel linears]}; null: DeepSpeed's AutoTP parser (engine.injection_policy=infer: dsexp's)
    injection_policy: Optional[Dict[str, List[str]]] = None
    dims: Dict[str, Any] = field(default_factory=dict)  # config kwargs (on top of config_path's config.json)


@dataclass
class LoadConfig:
    name: str = "eager"
    format: str = "safetensors"  # safetensors | bin: the checkpoint format the ranks read (sharded: the source's)
    shard_dir: Optional[str] = None  # sharded: where split checkpoints are cached (null: <cache_dir>/shards)
    # recompute non-persistent buffers (RoPE) from the model's constructor after load and engine; False: compared
    # and recorded, not changed
    restore_buffers: bool = True


@dataclass
class EngineConfig:
    name: str = "init_inference"
    kernel_inject: bool = False
    # auto: the model preset's policy; null: DeepSpeed's AutoTP parser (hf_tp: its tp_plan); infer: dsexp's
    # inference; or {LayerClass: [linears]}
    injection_policy: Any = "auto"
    max_out_tokens: int = 1024
    replace_method: Optional[str] = None  # the seed passes "auto" (deprecated, ignored by DeepSpeed)
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
    grace_s: float = 10.0  # after a timeout: SIGTERM, this long, then SIGKILL for the whole process group
    # true: jobs of a sweep that run at once get disjoint GPUs (hydra/launcher=dsexp_local; dsexp.job.cluster.packing)
    pack: bool = False
    nodes: int = 1  # > 1: ranks span nodes (tp/nodes per node); docs/cluster.md
    hostfile: Optional[str] = None  # deepspeed, nodes > 1: "host slots=N" lines; null: from the SLURM allocation
    gpus: Optional[int] = None  # GPUs per node the ranks use (null: one per rank); fewer: shared round-robin (gloo)


@dataclass
class GenerateConfig:
    """The workload's shape. batch_size and prompt_tokens are each an int or a list: a list is a grid run inside one job
    (the model loads once; each point its own phase, dsexp.core.workload, started from an emptied cache). prompt_tokens
    null: the prompt text as the model's tokenizer cuts it; N: a prompt of exactly N tokens (the text's ids repeated),
    the same on every rank and in the tp=1 reference. Each point: `warmup` untimed generate calls, then `repeats` timed
    ones of `new_tokens` tokens (each stamped at its first token), and at the grid's first point one prefill (generate
    with one new token) for the logits."""

    prompt: str = "what is deepspeed?"
    new_tokens: int = 16
    batch_size: Any = 1
    prompt_tokens: Any = None
    repeats: int = 1
    # untimed calls first (as optimum-benchmark and vLLM do): the first call's one-time costs (kernels chosen, caches
    # built) stay out of TTFT, TPOT and tokens/s; on CPU a cold first call of the tiny model took 14x a warm one
    warmup: int = 1
    # a batch of the batch_size list: the list is searched from it (dsexp.core.bisect) instead of run whole, until
    # the largest batch that runs and the smallest that runs out of memory are neighbours; the model loads once. The
    # budget search sets it to the memory model's guess; null: every point of the grid runs
    bisect_from: Optional[int] = None


@dataclass
class ProbeConfig:
    # background peak sampler period (<= 20 ms); 0: no sampler, peaks = phase-end readings. 20: its thread costs
    # 0.7% of a core on the H200 where 10 ms cost 1.3-1.5% (results/h200/sampler_cost, dsexp.rank.probes.sampler)
    sample_ms: float = 20.0
    see_memory_usage: bool = True  # also record what DeepSpeed's see_memory_usage prints, for comparison
    nvidia_smi: bool = False  # also record `nvidia-smi` per phase (cross-check on GPU machines)
    # One tiny all_reduce at the end of `start` (GPU), read before and after: it creates the NCCL communicator, so
    # the memory it takes is measured apart. null: only when tp > 1 (a 1-rank job has no communicator otherwise).
    first_collective: Optional[bool] = None
    # GPU: a PyTorch memory snapshot per rank and phase (ranks/snapshots/rank{N}_{phase}.pickle, for
    # pytorch.org/memory_viz): at most snapshot_max_entries allocator events a phase, no file over snapshot_max_mb.
    memory_snapshot: bool = False
    snapshot_max_entries: int = 50000
    snapshot_max_mb: float = 256.0


@dataclass
class CheckConfig:
    correctness: bool = True  # compare first-step logits with a cached tp=1 reference
    rel_err_tol: Optional[float] = None  # null: by dtype (bf16 5e-2, fp16 1e-2, fp32 1e-4; dsexp/job/correctness.py)


@dataclass
class TrimConfig:
    """What stays replicated on every GPU, removed (`trim=` group; each key alone or with the others).

    dedupe_buffers: identical non-persistent buffers (per-layer rotary tables) share one tensor on each device.
    shard_head: AutoTP splits the output head whatever its attribute name (DeepSpeed's LmHeadLinearAllreduce).
    shard_embedding: DeepSpeed's VocabParallelEmbedding for the input embedding (vocabulary rows split).
    world_group: AutoTP all-reduces on the world process group (tp == world size): DeepSpeed creates no second
    communicator. last_logits: in generate, the output head computes the last position's logits only (a model whose
    code drops transformers' logits_to_keep computes every prompt position's, whole on every rank; not in trim=all,
    which removes what the weights replicate). env: environment variables for the ranks (NCCL, CUDA module loading,
    allocator, cuBLAS).
    """

    name: str = "none"
    dedupe_buffers: bool = False
    shard_head: bool = False
    shard_embedding: bool = False
    world_group: bool = False
    last_logits: bool = False
    env: Dict[str, str] = field(default_factory=dict)


@dataclass
class QuantConfig:
    """Quantized weights and KV cache (`quant=` group): one weight member per `quant=<name>` (dsexp/quant/<name>/:
    what it is, the library call it makes, where it applies, its memory rule), and a quantized KV cache through
    transformers' own QuantizedCache (`quant.kv=4`), with any weight member (`quant=fp8_weight quant.kv=4`).

    order: auto (the member's own: as the weights reach the device where the library can), stream (each linear moved
    to the device and quantized there, one at a time: the device never holds the model in the run dtype), after (the
    engine places the model in the run dtype, then it is quantized in place: what a quantize-after-load leaves).
    quality_tol: the first-step logits' relative error against the tp=1 run without quantization that a run may show
    (null: the member's own); on random weights that is numerical agreement, not task accuracy.
    empty_cache: each (torchao's members on a GPU: the allocator's cache emptied after each linear is quantized, so no
    segment that held a run-dtype weight outlives it with a quantized weight inside), end (once, after the phase: the
    quantized weights split the segments the run-dtype weights left, and their free rest stays reserved).
    head: torchao's members leave the output head in the run dtype, as transformers' TorchAoConfig does; true
    quantizes it with the member too (its logits pay for it in quality: the report shows what).
    head_first: with head and empty_cache=each, the head is quantized before the other linears, while the device holds
    least: it is the largest weight, and tinygemm's int4 packing holds five times its bf16 bytes beside it (8.35 GiB
    at the phase's peak on the H100 for 5.30 GiB of int4 weights at tp=2, the head last); false: the model's order."""

    name: str = "none"
    group_size: Optional[int] = None  # the member's group (elements sharing one scale); null: the member's default
    order: str = "auto"
    kv: Optional[int] = None  # the KV cache's bits (quanto: 4, 2; hqq: 8, 4, 2); null: the run dtype
    kv_backend: str = "quanto"  # transformers' QuantizedCache backend: quanto | hqq
    kv_group_size: int = 64  # elements of the cache sharing one scale and zero-point
    kv_residual: int = 128  # newest tokens the cache keeps in the run dtype before it quantizes them (residual_length)
    quality_tol: Optional[float] = None
    empty_cache: str = "each"
    head: bool = False  # torchao's members: quantize the output head too (it stays in the run dtype by default)
    head_first: bool = True  # with head (and empty_cache=each): the head quantized before the other linears
    # false: run a member with an engine it is known not to compose with, to see the library's own error (the
    # composition matrix, campaigns/quant_compose.yaml, does); the device checks still apply
    check_composition: bool = True

    @property
    def active(self) -> bool:
        return self.name != "none" or self.kv is not None or self.head


@dataclass
class ScriptConfig:
    """A user's own inference script, run as written on every rank instead of dsexp's pipeline (`script.path`).

    args: its command line; `{model_dir}` in an argument is the model group's checkpoint folder (dsexp writes it).
    fix: remedies dsexp applies through its hooks (dsexp.rank.workloads.script_fixes); [] runs it as written.
    max_new_tokens: a cap on what the script's generate calls ask for (null: as written), for quick measurements.
    local_rank_arg: the DeepSpeed launcher passes --local_rank=N to the script (as `deepspeed script.py` does);
    false: --no_local_rank. torchrun never passes it."""

    path: Optional[str] = None
    args: List[str] = field(default_factory=list)
    fix: Any = field(default_factory=list)  # a list of remedies; one written plainly (script.fix=all) is [all]
    max_new_tokens: Optional[int] = None
    local_rank_arg: bool = True

    def __post_init__(self) -> None:
        fix = self.fix if isinstance(self.fix, (list, tuple)) else [] if self.fix in (None, "") else [self.fix]
        self.fix = [str(f) for f in fix]  # validation names any that is not a remedy


@dataclass
class BudgetConfig:
    """A memory budget: "N GPUs of X GiB and H GiB of host". Set, it turns a sweep into a search
    (`hydra/sweeper=dsexp_budget`, dsexp.compose.budget): the sweep's dimensions are the space, the batch
    (generate.batch_size) is searched between batch_min and batch_max in steps of batch_step.

    gpu_gib is what one GPU (one rank) may use, all of it: on a GPU each rank caps its caching allocator at gpu_gib
    minus what lives outside it (CUDA context, communicator), so a larger GPU stands in for one of this size. On a
    CPU run the device budget is simulated (dsexp.rank.budget_cap): cpu_scale multiplies the memory model's bytes above
    the weights there (> 1: a card that needs more than the model says, as tests make it)."""

    gpus: Optional[int] = None  # GPUs the budget has (a configuration with tp > gpus does not fit)
    gpu_gib: Optional[float] = None  # memory of each GPU, GiB
    # the GPUs' compute capability ("8.0"; a gpu= preset names it): a quant member that needs more is refused, as on
    # a GPU of its own (null: the GPU the ranks run on is asked)
    gpu_capability: Optional[str] = None
    host_gib: Optional[float] = None  # host memory of the node, GiB (null: not limited)
    batch_min: int = 1
    batch_max: int = 256
    batch_step: int = 1
    enforce: bool = True  # GPU: cap each rank's allocator at the budget (false: compared only)
    cpu_scale: float = 1.0
    # dsexp's own workload: a configuration's whole batch search in one job, the model loaded once
    # (generate.bisect_from); false: a job per guess, running it and the next batch (a fresh process at every load)
    one_load: bool = True
    # on a GPU, an answer that ran after other points of its load, closer to the budget than confirm_margin_gib, is
    # run again as a fresh load's first point (a process's first generate reserved more than a later one of the same
    # batch, by more than 0.17 GiB at 4 x 19 GiB: dsexp.compose.budget.search.fresh_answer)
    confirm_first: bool = True
    confirm_margin_gib: float = 0.5

    @property
    def active(self) -> bool:
        return self.gpu_gib is not None or self.gpus is not None or self.host_gib is not None


MODEL_DIR_ARG = "{model_dir}"
# what a script's arguments may name, each filled in before launch: the model group's checkpoint folder and the
# workload's shape (generate.batch_size / prompt_tokens / new_tokens), so the memory model and the script agree
SCRIPT_PLACEHOLDERS = ("model_dir", "batch_size", "prompt_tokens", "new_tokens")
_PLACEHOLDER = re.compile(r"\{([A-Za-z_][A-Za-z0-9_]*)\}")


def placeholders(args: List[Any]) -> List[str]:
    """The `{name}` placeholders the arguments carry, in order, each once."""
    return list(dict.fromkeys(m for a in args for m in _PLACEHOLDER.findall(str(a))))


def fill_args(args: List[Any], values: Dict[str, Any]) -> List[str]:
    """The arguments with each known placeholder replaced by its value (the others left as written)."""

    def value(m: re.Match) -> str:
        return str(values[m.group(1)]) if m.group(1) in values else m.group(0)

    return [_PLACEHOLDER.sub(value, str(a)) for a in args]


@dataclass
class TrackingConfig:
    uri: Optional[str] = None  # null: $MLFLOW_TRACKING_URI, else sqlite:///<launch dir>/mlflow.db; none: no MLflow
    experiment: str = "dsexp"


# Packages a stack may pin (`stack.<name>=<version>`), as Python import names; DISTRIBUTIONS maps the exceptions.
STACK_PACKAGES = ("transformers", "deepspeed", "tokenizers", "huggingface_hub", "numpy", "accelerate", "safetensors")
DISTRIBUTIONS = {"huggingface_hub": "huggingface-hub"}


@dataclass
class StackConfig:
    """The software the ranks run on. No pins: the job's own environment. Pins: an overlay of exactly those
    packages (and what they need) on top of the job environment's torch, prepared once and cached."""

    name: str = "current"
    transformers: Optional[str] = None
    deepspeed: Optional[str] = None
    tokenizers: Optional[str] = None
    huggingface_hub: Optional[str] = None
    numpy: Optional[str] = None
    accelerate: Optional[str] = None
    safetensors: Optional[str] = None
    wheelhouse: Optional[str] = None  # install from this folder only (offline machines: `python -m dsexp.stacks fill`)


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
    trim: TrimConfig = field(default_factory=TrimConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    stack: StackConfig = field(default_factory=StackConfig)
    script: ScriptConfig = field(default_factory=ScriptConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)
    tp: int = 1  # ranks (= GPUs on a GPU machine); a plain int so `-m tp=1,2,4` works
    # conf/config.yaml sets dtype to ${model.dtype} and cache_dir to $DSEXP_CACHE or ~/.cache/dsexp; the values
    # here fill records of an older schema that lack them
    dtype: str = "bf16"  # the dtype the engine runs in; differs from model.dtype => the load converts
    device: str = "auto"  # auto | cpu | cuda
    variant: Optional[str] = None  # a free label shown in reports (presets name their configuration with it)
    cache_dir: str = "~/.cache/dsexp"
    timeout_s: float = 900.0  # the whole job (all ranks); then the ranks' process group is killed
    rerun: bool = False  # true: run even if this sweep already holds an ok result for this configuration
    fault: Any = None  # debug=fault: a fault injected in a rank (tests)

    @property
    def ranks_per_node(self) -> int:
        return per_node(self.tp, self.launcher.nodes)

    @property
    def workload(self) -> str:
        """What the ranks run: a user's script (script.path) or dsexp's own pipeline."""
        return "script" if self.script.path else "pipeline"

    @property
    def uses_model(self) -> bool:
        """Whether the model group's checkpoint is used: always by the pipeline, by a script through {model_dir}."""
        return self.workload == "pipeline" or any(MODEL_DIR_ARG in str(a) for a in self.script.args)

    def script_values(self, model_dir: str = "") -> Dict[str, Any]:
        """What a script's placeholders stand for in this job (fill_args)."""
        g = self.generate
        return {"model_dir": model_dir, "batch_size": g.batch_size, "prompt_tokens": g.prompt_tokens,
                "new_tokens": g.new_tokens}  # fmt: skip

    @property
    def shared_gpu(self) -> bool:
        """More ranks on a node than GPUs given to them (launcher.gpus): ranks share GPUs, over gloo."""
        return self.device == "cuda" and is_shared(self.launcher.gpus, self.ranks_per_node)


def is_shared(gpus: Optional[int], ranks_per_node: int) -> bool:
    return gpus is not None and int(gpus) < ranks_per_node


def per_node(tp: int, nodes: int) -> int:
    """Ranks (GPUs) each node runs; rounded up so a config the validation will reject still composes."""
    return -(-int(tp) // max(1, int(nodes)))


def stack_pins(stack: Any) -> Dict[str, str]:
    """{distribution name: requirement} of a stack (a StackConfig or its dict); empty: the job's environment.
    A bare version means ==version; anything else (">=4.43,<4.44") is used as given."""
    get = stack.get if isinstance(stack, dict) else lambda k, d=None: getattr(stack, k, d)
    out = {}
    for pkg in STACK_PACKAGES:
        value = get(pkg)
        if value not in (None, ""):
            value = str(value).strip()
            dist = DISTRIBUTIONS.get(pkg, pkg)
            out[dist] = f"{dist}=={value}" if value[0].isdigit() else f"{dist}{value}"
    return out


def stack_label(stack: Any) -> str:
    """A stack's short name: its preset name, plus any pin that differs from the preset's (e.g.
    "current+transformers=4.46.3"); "current" for the job's own environment."""
    get = stack.get if isinstance(stack, dict) else lambda k, d=None: getattr(stack, k, d)
    name = get("name") or "current"
    preset = STACK_PRESETS.get(name, {})
    extra = [
        f"{pkg}={get(pkg)}" for pkg in STACK_PACKAGES if get(pkg) not in (None, "") and str(get(pkg)) != preset.get(pkg)
    ]
    return "+".join([name, *extra])


# The pins of the presets in conf/stack/ (a label names only what differs from its preset).
STACK_PRESETS: Dict[str, Dict[str, str]] = {
    "current": {},
    "seed": {
        "transformers": "4.42.4",
        "deepspeed": "0.14.4",
        "tokenizers": "0.19.1",
        "huggingface_hub": "0.24.7",
        "numpy": "1.26.4",
    },
}


def version_tuple(text: str) -> tuple:
    """ "0.14.4" -> (0, 14, 4); local parts and suffixes ("2.11.0+cu130", "1.0rc1") are dropped."""
    parts = []
    for piece in str(text).split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def dtype_conversion(model_dtype: str, dtype: str) -> Optional[str]:
    """The checkpoint's dtype to the run's, e.g. "fp32->bf16"; None when they are the same."""
    return None if model_dtype == dtype else f"{model_dtype}->{dtype}"


def from_dict(cls, data: Dict[str, Any], strict: bool = True, _path: str = ""):
    """Build the dataclass `cls` from plain data (e.g. `asdict` read back from JSON), nested groups included.

    strict: an unknown key is an error naming it; otherwise it is dropped (records written by older versions).
    Missing keys take the dataclass defaults."""
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown and strict:
        raise ConfigError(f"unknown config key(s): {', '.join(_path + k for k in unknown)}")
    kwargs = {}
    for name in names & set(data):
        value, hint = data[name], hints[name]
        if dataclasses.is_dataclass(hint) and isinstance(value, dict):
            value = from_dict(hint, value, strict, f"{_path}{name}.")
        kwargs[name] = value
    return cls(**kwargs)
