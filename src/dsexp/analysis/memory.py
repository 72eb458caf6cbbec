"""The memory model applied to a recorded (or configured) job: the settings that decide placement, read from the
result (`strategy_of`), the model rebuilt on the meta device, the rules of the engine and trims that ran
(dsexp.engines.placement) and what the run itself measured outside PyTorch's allocator. The model itself is
dsexp.predict; this module only gathers what it needs from a job.

KV cache: dsexp.predict.kv. Device memory outside PyTorch's allocator (CUDA context, NCCL communicator, cuBLAS
workspaces, most created after `start`): measured by the run itself, see `nonpytorch_overhead`. Host: what loading
costs each rank, by loading strategy (dsexp.predict.weights_per_rank.host).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.analysis.user_script import as_configured, as_pipeline_result, is_script
from dsexp.core.result import JobRecord, Phase
from dsexp.engines import ENGINES
from dsexp.engines.base import effective_policy
from dsexp.engines.placement import allocation_order, place, shared_buffers
from dsexp.predict import architecture as arch
from dsexp.predict.kv import kv_bytes, kv_heads
from dsexp.predict.placements import Strategy
from dsexp.predict.weights_per_rank import Prediction, host, per_rank, reserve
from dsexp.trims import active as active_trims
from dsexp.trims import last_position_logits


def predict(result: Dict[str, Any], tp: Optional[int] = None) -> Prediction:
    """The memory model for this run's configuration, at its own tp or another one. A user's script is predicted
    from what its ranks did (the call it made, the model it loaded: dsexp.analysis.user_script), not from a preset;
    before it ran (a config alone), from its config and the remedies it asks (user_script.as_configured)."""
    if is_script(result):  # as it ran, or (a config alone, nothing run yet) as its config says
        result = as_pipeline_result(result) if "status" in result else as_configured(result)
    strategy = strategy_of(result)
    tp = int(tp or (result.get("config") or {}).get("tp") or 1)
    source = arch.model_source(result.get("config") or {}, result.get("runtime"))
    model = arch.meta_model(source, strategy.dtype)
    placements, modules, notes, error, policy = place(
        model, strategy, tp, shared_buffers(source, strategy), with_policy=True
    )
    weights = per_rank(placements, tp)
    tokens = _tokens(result, strategy)
    d = arch.dims(model)
    kv = [kv_bytes(d, kv_heads(d.kv_heads, tp, r, strategy.splits_weights), tokens, strategy.dtype) for r in range(tp)]
    return Prediction(
        tp=tp,
        strategy=strategy,
        placements=placements,
        weights=weights,
        reserve=reserve(placements, weights, strategy, allocation_order(strategy.engine)),
        kv_cache=kv,
        tokens=tokens,
        dims=d,
        overhead=nonpytorch_overhead(result),
        notes=notes,
        error=error,
        policy=policy,
        modules=modules,
        host=host(result, strategy, tp, weights, placements),
    )


def strategy_of(result: Dict[str, Any]) -> Strategy:
    """The settings that decide placement, as the job was configured (and, where it ran, as its ranks reported)."""
    from dsexp.core.schema import EngineConfig

    c = result.get("config") or {}
    model, eng, zero, load = (c.get(k) or {} for k in ("model", "engine", "zero", "load"))
    runtime = result.get("runtime") or {}
    dtype, model_dtype = c.get("dtype") or model.get("dtype", "bf16"), model.get("dtype", "bf16")
    conversion = runtime.get("conversion", f"{model_dtype}->{dtype}" if dtype != model_dtype else None)
    name = eng.get("name", EngineConfig.name)
    traits = ENGINES.get(name)
    return Strategy(
        engine=name,
        kernel_inject=bool(eng.get("kernel_inject")),
        policy=_policy_used(result),
        zero_stage=int(zero.get("stage") or 0),
        offload=zero.get("offload") or "none",
        dtype=dtype,
        model_dtype=model_dtype,
        load=load.get("name", "eager"),
        fmt=load.get("format", "safetensors"),
        device=runtime.get("device") or c.get("device") or "cpu",
        max_out_tokens=int(eng.get("max_out_tokens") or 0),
        conversion=conversion,
        restore_buffers=load.get("restore_buffers", True) is not False,
        trims=dict.fromkeys(active_trims(c.get("trim") or {}), True),
        deepspeed=_version(result, "deepspeed"),
        transformers=_version(result, "transformers"),
        casts_buffers=bool(traits and traits.casts_buffers),
        splits_weights=bool(traits and traits.splits_weights),
        expandable_segments="expandable_segments:true" in alloc_conf(c).replace(" ", "").lower(),
        last_position_logits=last_position_logits(c.get("trim") or {}),
    )


def _version(result: Dict[str, Any], package: str) -> Optional[str]:
    """The version of `package` the ranks ran (the record's software, else its stack's), None: unknown."""
    ran = ((result.get("software") or {}).get("versions") or {}).get(package)
    return ran or ((result.get("config") or {}).get("stack") or {}).get(package)


def alloc_conf(config: Dict[str, Any]) -> str:
    """PYTORCH_CUDA_ALLOC_CONF as the ranks got it (trim.env; a script's `context` fix sets it there too)."""
    return str(((config.get("trim") or {}).get("env") or {}).get("PYTORCH_CUDA_ALLOC_CONF") or "")


def _policy_used(result: Dict[str, Any]) -> Optional[Dict[str, List[str]]]:
    """The injection policy the engine reported it used, else what the config resolves to."""
    report = result.get("engine") or {}
    if "injection_policy" in report:
        return report["injection_policy"] or None
    eng, model = ((result.get("config") or {}).get(k) or {} for k in ("engine", "model"))
    return effective_policy(
        eng.get("injection_policy", "auto"), bool(eng.get("kernel_inject")), model.get("injection_policy")
    )


def splits_weights(engine: str) -> bool:
    """Whether the engine gives each rank its own slice of the weights and of the KV heads (tensor parallelism)."""
    return engine in ENGINES and ENGINES[engine].splits_weights


def _tokens(result: Dict[str, Any], s: Strategy) -> int:
    """Prompt + generated tokens (kernel injection sizes its KV workspace for max_out_tokens instead)."""
    gen = (result.get("config") or {}).get("generate") or {}
    if s.kernel_inject and s.max_out_tokens:
        return s.max_out_tokens
    rank0 = next(iter(JobRecord.of(result).ranks), None)
    prompt = (rank0.raw.get("generate") or {}).get("prompt_ids") if rank0 else None
    n_prompt = len(prompt) if prompt else len(str(gen.get("prompt", "")).encode())
    return n_prompt + int(gen.get("new_tokens") or 0)


def nonpytorch_overhead(result: Dict[str, Any]) -> Optional[int]:
    """Device memory the floor adds to weights and KV cache, max over ranks: the process's memory outside
    PyTorch's allocator at its largest over the phases (NVML process used - torch reserved: CUDA context, NCCL
    communicator, cuBLAS workspaces, which mostly appear after `start`) plus what the device itself holds apart
    from the process at `start` (NVML device used - process used). Runs without per-process NVML figures fall
    back to the device memory in use after `start`.

    Where ranks share a GPU, the per-GPU peak the floor is held against is each rank's own process (the headline,
    dsexp.core.records.headline): the device's reserve is not in it, so it is not in the floor either (counting it
    put the floor of every shared-GPU run on the H200 0.6 GiB above its measured peak)."""
    from dsexp.analysis.measured import device_reserve

    job = JobRecord.of(result)
    vals = []
    for rk in job.ranks:
        start = rk.phase(Phase.START).gpu
        outside = [
            ph.gpu["nvml_process_used"] - (ph.gpu.get("gpu_reserved") or 0)
            for ph in rk.phases()
            if ph.gpu.get("nvml_process_used")
        ]
        reserve = 0 if job.shared_gpu else device_reserve(result, rk)
        if outside and reserve is not None:
            vals.append(max(outside) + reserve)
        elif (start.get("nvml_device_used") or start.get("gpu_driver_used")) is not None:
            vals.append(start.get("nvml_device_used") or start.get("gpu_driver_used"))
    return max(vals) if vals else None


def shared_gpu_fit_of(spec, total: int):
    """The memory model's answer for a job whose ranks share GPUs (dsexp.predict.fit.shared_gpu_fit), from its
    config alone; None where the model cannot predict it (the run will say)."""
    from dataclasses import asdict

    from dsexp.predict.fit import shared_gpu_fit

    try:
        pred = predict({"config": asdict(spec), "runtime": {"device": "cuda"}})
    except Exception:
        return None
    return shared_gpu_fit(pred, spec.ranks_per_node, int(spec.launcher.gpus), total)
