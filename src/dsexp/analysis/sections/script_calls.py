"""The "script_calls" section: each generate call a user's script made, as facts (its batch, prompt length and new
tokens, recorded by the script workload's hooks), beside the memory model's bytes above the weights for that call
(dsexp.predict.capacity, from the model and the engine call the script made) and, on a GPU, what the rank held
above its weights during the call."""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Optional

from dsexp.analysis.labels import config_label
from dsexp.analysis.matrix import Row
from dsexp.analysis.sections.common import ReportInputs, size
from dsexp.analysis.user_script import generate_calls, is_script, kernel_injection_without_policy
from dsexp.core.result import Phase
from dsexp.predict import capacity as cap

NAME = "script_calls"


def render(inputs: ReportInputs) -> str:
    rows = [r for r in inputs.rows if is_script(r.result) and generate_calls(r.result)]
    if not rows:
        return ""
    lines = [
        "## Your script's generate calls",
        "",
        "Each generate call on rank 0 as the script made it: its batch (the sequences it returned), its prompt's "
        "length and the tokens it added. Predicted: the memory model's bytes above the weights for that call, max "
        "over ranks (a prediction). Measured (GPU): the rank's allocated peak during the call minus its weights "
        "allocated at the end of init (or its load, where the script made no engine call).",
        "",
        "| configuration | tp | call | caller | batch | prompt | new tokens | predicted above weights | measured |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for i, c in enumerate(generate_calls(r.result), 1):
            predicted, measured = size(predicted_above(r, c)), size(measured_above(r, c))
            lines.append(
                f"| `{config_label(r.config)}` | {r.tp} | {i} | {c.get('caller') or '-'} | {c.get('sequences', 1)} | "
                f"{c['prompt_tokens']} | {c['new_tokens']} | {predicted} | {measured} |"
            )
    return "\n".join(lines + [""])


def predicted_above(r: Row, call: Dict[str, Any]) -> Optional[int]:
    p = r.prediction
    if p is None or not p.dims.hidden:
        return None
    work = cap.Workload(int(call.get("sequences", 1)), int(call["prompt_tokens"]), max(1, int(call["new_tokens"])))
    strategy, tp = p.strategy, r.tp
    if strategy.kernel_inject and kernel_injection_without_policy(r.result):
        # it replaced and split nothing: no workspace, every rank runs the whole model
        strategy, tp = dataclasses.replace(strategy, kernel_inject=False), 1
    terms = cap.above_weights(p.dims, strategy, tp, work)
    return max(cap.peak_per_rank([0] * tp, terms))


def measured_above(r: Row, call: Dict[str, Any]) -> Optional[int]:
    """On a GPU: rank 0's allocated peak in the call's phase minus its weights (None on the CPU)."""
    if not r.record.on_gpu or not call.get("phase"):
        return None
    rank0 = next(iter(r.record.ranks), None)
    if rank0 is None:
        return None
    peak = rank0.phase(call["phase"]).gpu.get("gpu_alloc_peak")
    base = rank0.phase(Phase.INIT).gpu.get("gpu_alloc") or rank0.phase(Phase.LOAD).gpu.get("gpu_alloc")
    return peak - base if peak is not None and base is not None else None
