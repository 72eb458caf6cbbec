"""The budget on a rank (budget.*): a GPU of budget.gpu_gib, enforced; on a CPU run, simulated.

GPU: the rank caps its caching allocator with torch.cuda.set_per_process_memory_fraction at the budget minus what
this process holds outside the allocator (its CUDA context and communicator, measured at the end of `start`), so a
larger GPU runs out of memory where a GPU of the budget's size would. Memory outside the allocator that comes later
(cuBLAS workspaces) is not capped: the search compares the measured peaks with the budget too.

CPU: there is no device allocator to cap. Each workload point's device need is simulated as the weights this rank
holds (measured after init) plus the memory model's bytes above the weights for the point (dsexp.predict.capacity;
the job hands each rank those bytes: dsexp.job.budget) times budget.cpu_scale; past the budget the point raises
torch.OutOfMemoryError, as a capped GPU would, and the capacity workload records it as an out-of-memory point. The
rank records which of the two it did. A user's script under a budget is held the same way: its allocator capped at the
end of its `start`, or each of its generate calls simulated at the batch its {batch_size} took; the error reaches the
script, whose job fails out of memory (cause oom_gpu), the search's boundary.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

GIB = 2**30


def held_to_budget(ctx) -> bool:
    """The measured run only: the tp=1 reference and the split are the job's tools, not the configuration."""
    return ctx.runtime.get("workload", "pipeline") == "pipeline" and budget_bytes(ctx.spec) is not None


def budget_bytes(spec) -> Optional[int]:
    b = spec.budget
    return int(b.gpu_gib * GIB) if b.active and b.gpu_gib is not None else None


def cap_allocator(device_index: int, budget: int, outside: int) -> Dict[str, Any]:
    """Cap this process's allocator at budget - outside bytes of the device; what was set, for the rank's record."""
    import torch

    total = torch.cuda.get_device_properties(device_index).total_memory
    cap = max(0, budget - outside)
    fraction = min(1.0, cap / total)
    torch.cuda.set_per_process_memory_fraction(fraction, device_index)
    return {
        "how": "enforced",
        "budget_bytes": budget,
        "outside_bytes": outside,
        "cap_bytes": cap,
        "fraction": fraction,
        "device_total": total,
    }


def outside_bytes(readings: Dict[str, Dict[str, Optional[int]]], device_index: int) -> int:
    """This process's device bytes outside the allocator at the latest reading of `start` (after the communicator
    where there is one). Where NVML could not see the process: the device's used bytes minus this allocator's
    reserve, which counts other processes on the GPU too (a smaller cap: the budget errs on the safe side)."""
    for name in ("communicator", "context"):
        value = (readings.get(name) or {}).get("outside")
        if value is not None:
            return int(value)
    import torch

    free, total = torch.cuda.mem_get_info(device_index)
    return max(0, total - free - torch.cuda.memory_reserved(device_index))


def enforce(ctx, device_index: int, readings: Dict[str, Dict[str, Optional[int]]]) -> Optional[Dict[str, Any]]:
    """A GPU rank of the measured run under a budget (budget.enforce): cap its allocator (cap_allocator); None
    otherwise."""
    if not held_to_budget(ctx) or not ctx.spec.budget.enforce:
        return None
    return cap_allocator(device_index, budget_bytes(ctx.spec), outside_bytes(readings, device_index))


def enforce_script(spec, device_index: int, readings: Dict[str, Dict[str, Optional[int]]]) -> Optional[Dict[str, Any]]:
    """A GPU rank of a user's script under a budget (budget.enforce), at the end of its `start`: cap its allocator
    as a pipeline rank's (enforce); None without a budget (the world-size-1 reference has none)."""
    if budget_bytes(spec) is None or not spec.budget.enforce:
        return None
    return cap_allocator(device_index, budget_bytes(spec), outside_bytes(readings, device_index))


def simulated_need(weights: int, above: int, scale: float) -> int:
    """A CPU run's stand-in for a point's device need: the weights held plus the model's bytes above them, scaled."""
    return int(weights + above * scale)


def simulate_point(ctx, weights: Optional[int], point) -> Optional[Dict[str, Any]]:
    """A CPU rank under a budget: this workload point's simulated device need (module docstring), for the rank's
    record; None on a GPU (the cap holds there) or without a budget."""
    if ctx.on_gpu or not held_to_budget(ctx) or weights is None:
        return None
    return simulated_record(ctx.spec, weights, above_weights_bytes(ctx, point.batch, point.prompt_tokens))


def simulate_script_call(spec, runtime: Dict[str, Any], rank: int, weights: Optional[int]) -> Optional[Dict[str, Any]]:
    """A CPU rank of a user's script under a budget: a generate call's simulated device need, at the batch the
    script's {batch_size} took (dsexp.job.budget.above_per_point); None on a GPU, without a budget (the world-size-1
    reference has none) or before the rank holds weights."""
    above = (runtime.get("budget_above") or {}).get(str(spec.generate.batch_size))
    if runtime.get("device") == "cuda" or budget_bytes(spec) is None or above is None or weights is None:
        return None
    return simulated_record(spec, weights, int(above[rank]))


def simulated_record(spec, weights: int, above: int) -> Dict[str, Any]:
    """The simulated point, for the rank's record (module docstring)."""
    budget, scale = budget_bytes(spec), spec.budget.cpu_scale
    need = simulated_need(weights, above, scale)
    return {
        "how": "simulated",
        "simulated_need": need,
        "weights": weights,
        "above": above,
        "cpu_scale": scale,
        "budget_bytes": budget,
        "fits": need <= budget,
    }


def check_simulated(simulated: Optional[Dict[str, Any]]) -> None:
    """Past the budget: the out-of-memory error a GPU of the budget's size would raise."""
    if simulated and not simulated["fits"]:
        import torch

        raise torch.OutOfMemoryError(
            f"dsexp budget (simulated on the CPU): this point needs {simulated['simulated_need'] / GIB:.3f} GiB, "
            f"over the budget's {simulated['budget_bytes'] / GIB:.3f} GiB"
        )


def above_weights_bytes(ctx, batch: int, prompt_tokens: Optional[int]) -> int:
    """The memory model's bytes above the weights on this rank at this point, as the job computed them for every
    point of its grid (dsexp.job.budget: the model the budget search predicted with)."""
    return int(ctx.runtime["budget_above"][str(batch)][ctx.rank])
