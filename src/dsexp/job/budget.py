"""A CPU job under a budget: the memory model's bytes above the weights for each workload point, per rank, handed to
the ranks in job.json (`runtime["budget_above"]`), where dsexp.rank.budget_cap simulates each point's device need
with them (a user's script: the one batch its {batch_size} takes, checked at each of its generate calls; its loading and
trims, which its script.fix decides, do not change the bytes above the weights). The same model and settings the
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
    from dsexp.trims import last_position_logits

    dims = arch.dims(arch.meta_model(arch.model_source(asdict(spec), runtime), spec.dtype))
    traits = ENGINES.get(spec.engine.name)
    strategy = SimpleNamespace(  # the settings capacity reads (analysis.memory.strategy_of has them all)
        dtype=spec.dtype,
        kernel_inject=spec.engine.kernel_inject,
        max_out_tokens=spec.engine.max_out_tokens,
        splits_weights=bool(traits and traits.splits_weights),
        device=spec.device,
        last_position_logits=last_position_logits(spec.trim),
    )
    out = {}
    for point in grid(spec.generate):
        w = Workload(point.batch, int(point.prompt_tokens or 0), int(spec.generate.new_tokens))
        out[str(point.batch)] = peak_per_rank([0] * spec.tp, above_weights(dims, strategy, spec.tp, w))
    return out


def budget_runtime(spec: JobConfig, runtime: Dict[str, Any]) -> Dict[str, Any]:
    """What the ranks need to simulate the budget: only a CPU run under a budget has it (dsexp's pipeline or a
    user's script)."""
    if not spec.budget.active or spec.device == "cuda":
        return {}
    return {"budget_above": above_per_point(spec, runtime)}
