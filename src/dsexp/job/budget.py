"""A CPU job under a budget: the memory model's bytes above the weights for each workload point, per rank, handed to
the ranks in job.json (`runtime["budget_above"]`), where dsexp.rank.budget_cap simulates each point's device need
with them (a user's script: its one batch, checked at each of its generate calls). The same model and settings the
budget search predicted with (dsexp.compose.budget.model): the meta-built model's dims, the engine's traits, the
capacity model (dsexp.predict.capacity)."""

from __future__ import annotations

from dataclasses import asdict
from types import SimpleNamespace
from typing import Any, Dict, List

from dsexp.core.schema import JobConfig
from dsexp.core.workload import grid


def above_per_point(spec: JobConfig, runtime: Dict[str, Any]) -> Dict[str, List[int]]:
    """{batch: bytes above the weights on each rank} for every point of the job's grid."""
    from dsexp.engines import ENGINES
    from dsexp.predict import architecture as arch
    from dsexp.predict.capacity import Workload, above_weights, peak_per_rank

    dims = arch.dims(arch.meta_model(arch.model_source(asdict(spec), runtime), spec.dtype))
    traits = ENGINES.get(spec.engine.name)
    strategy = SimpleNamespace(  # the settings capacity reads (analysis.memory.strategy_of has them all)
        dtype=spec.dtype,
        kernel_inject=spec.engine.kernel_inject,
        max_out_tokens=spec.engine.max_out_tokens,
        splits_weights=bool(traits and traits.splits_weights),
        device=spec.device,
    )
    out = {}
    for point in grid(spec.generate):
        w = Workload(point.batch, int(point.prompt_tokens or 0), int(spec.generate.new_tokens))
        out[str(point.batch)] = peak_per_rank([0] * spec.tp, above_weights(dims, strategy, spec.tp, w))
    return out


def above_for_script(spec: JobConfig) -> Dict[str, List[int]]:
    """{batch: bytes above the weights on each rank} for a user's script at the batch its {batch_size} takes: the
    prediction the budget search made for it (its config and remedies: dsexp.analysis.user_script.as_configured),
    the capacity model's fit terms at generate.prompt_tokens / new_tokens (what {prompt_tokens} / {new_tokens} say)."""
    from dsexp.analysis.memory import predict
    from dsexp.predict.capacity import Workload, fit_terms, peak_per_rank

    pred = predict({"config": asdict(spec), "runtime": {"device": spec.device}}, spec.tp)
    g = spec.generate
    w = Workload(int(g.batch_size), int(g.prompt_tokens or 0), int(g.new_tokens))
    return {str(w.batch): peak_per_rank([0] * spec.tp, fit_terms(pred.dims, pred.strategy, spec.tp, w))}


def budget_runtime(spec: JobConfig, runtime: Dict[str, Any]) -> Dict[str, Any]:
    """What the ranks need to simulate the budget: only a CPU run under a budget has it."""
    if not spec.budget.active or spec.device == "cuda":
        return {}
    if spec.workload == "script":
        return {"budget_above": above_for_script(spec)}
    return {"budget_above": above_per_point(spec, runtime)}
