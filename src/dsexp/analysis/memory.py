"""The memory model set beside a recorded job: what its run adds to its config (`facts_of`: the checkpoint's folder,
the versions and device its ranks had, the policy the engine reported, what it measured outside PyTorch's allocator)
handed to the one prediction every caller makes (dsexp.predict.job.predict, with the families' rules,
dsexp.engines.placement). This module builds no model of its own.

KV cache: dsexp.predict.kv. Device memory outside PyTorch's allocator (CUDA context, NCCL communicator, cuBLAS
workspaces, most created after `start`): measured by the run itself, see `nonpytorch_overhead`. Host: what loading
costs each rank, by loading strategy (dsexp.predict.weights_per_rank.host).
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.analysis.user_script import as_configured, as_pipeline_result, is_script
from dsexp.core.result import JobRecord, Phase
from dsexp.engines import ENGINES
from dsexp.engines.placement import RULES
from dsexp.predict import job as model
from dsexp.predict.weights_per_rank import Prediction


def predict(result: Dict[str, Any], tp: Optional[int] = None) -> Prediction:
    """The memory model for this run's configuration, at its own tp or another one. A user's script is predicted
    from what its ranks did (the call it made, the model it loaded: dsexp.analysis.user_script), not from a preset;
    before it ran (a config alone), from its config and the remedies it asks (user_script.as_configured)."""
    if is_script(result):  # as it ran, or (a config alone, nothing run yet) as its config says
        result = as_pipeline_result(result) if "status" in result else as_configured(result)
    return model.predict(result.get("config") or {}, RULES, facts_of(result), tp)


def facts_of(result: Dict[str, Any]) -> model.Facts:
    """What the run says beyond its config (a config alone: nothing but the device it asks)."""
    runtime = result.get("runtime") or {}
    report = result.get("engine") or {}
    rank0 = next(iter(JobRecord.of(result).ranks), None)
    prompt = (rank0.raw.get("generate") or {}).get("prompt_ids") if rank0 else None
    return model.Facts(
        model_dir=runtime.get("model_dir"),
        device=runtime.get("device"),
        conversion=runtime["conversion"] if "conversion" in runtime else model.NOT_REPORTED,
        versions={k: v for k, v in ((result.get("software") or {}).get("versions") or {}).items() if v},
        policy_used=report["injection_policy"] if "injection_policy" in report else model.NOT_REPORTED,
        prompt_len=len(prompt) if prompt else None,
        overhead=nonpytorch_overhead(result),
    )


# Above the weights, what a measured run already holds in its bytes outside PyTorch's allocator: kernel injection's
# workspace (DeepSpeed's GenWorkSpace takes it with cudaMalloc, not through the caching allocator)
MEASURED_OUTSIDE = ("workspace",)


def workload_floor(result: Dict[str, Any], p: Prediction) -> Optional[Dict[str, Any]]:
    """The per-GPU floor a run is held to: at its largest workload point, the busiest rank's weights' reserve, every
    term above them the capacity model predicts (KV cache, activations, logits, cuBLAS's workspace) and the memory
    outside PyTorch's allocator as measured (which holds kernel injection's workspace: MEASURED_OUTSIDE):
    {bytes, terms (name -> bytes, that rank's), batch, prompt_tokens}. None where the run measured no outside bytes
    (a CPU run) or has no workload point."""
    if p.overhead is None:
        return None
    floors = []
    for w in ran(result, model.workloads_of(result.get("config") or {}, facts_of(result))):
        q = model.at(p, w, p.overhead)
        for r, reserve in enumerate(model.held(p)):
            above = {k: v[r] for k, v in q.terms.items() if v[r] and k not in MEASURED_OUTSIDE}
            terms = {"weights": reserve, **above, "outside": p.overhead}
            floors.append({"bytes": sum(terms.values()), "terms": terms, "batch": w.batch,
                           "prompt_tokens": w.prompt_tokens})  # fmt: skip
    return max(floors, key=lambda f: f["bytes"]) if floors else None


def ran(result: Dict[str, Any], workloads: List[Any]) -> List[Any]:
    """The workload points that ran on every rank (a grid's points out of memory or skipped hold no peak to bound);
    all of them where the ranks list no points (a script, a record before grids)."""
    listed = [rk.raw.get("points") for rk in JobRecord.of(result).ranks]
    if not listed or not all(listed):
        return workloads
    ok = set.intersection(
        *({(e["batch"], e.get("prompt_tokens")) for e in points if e.get("status") == "ok"} for points in listed)
    )
    return [w for w in workloads if (w.batch, w.prompt_tokens) in ok or (w.batch, None) in ok]


def splits_weights(engine: str) -> bool:
    """Whether the engine gives each rank its own slice of the weights and of the KV heads (tensor parallelism)."""
    return engine in ENGINES and ENGINES[engine].splits_weights


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
