"""The "capacity" section: what fits above the weights, per rank, at each workload point (batch x prompt tokens):
measured against the memory model (dsexp.predict.capacity), the terms the model counts, and the largest batch at
each prompt length that the model says fits the GPU the run had."""

from __future__ import annotations

from typing import List

from dsexp.analysis import measured as m
from dsexp.analysis import workload_points as capa
from dsexp.analysis.sections.common import ReportInputs, size

NAME = "capacity"
GIB = 2**30
TERMS = ("kv_cache", "activations_split", "activations_whole", "logits", "workspace", "cublas_workspace")


def render(inputs: ReportInputs) -> str:
    points = capa.point_rows(inputs.rows)
    if not points:
        return ""
    lines = ["## What fits: memory above the weights per rank", ""]
    lines += [
        "Measured: "
        + (
            "torch's allocated peak during the point's prefill or decode, minus the weights allocated at init."
            if any(q.on_gpu for q in points)
            else "the KV cache the generate call returned, against the model's KV cache term at the end (a CPU "
            "run: the countable part)."
        )
        + " Predicted: the memory model (a prediction), max over ranks; its terms at the peak per rank.",
        "",
        "| configuration | tp | batch | prompt | tokens | status | measured | predicted | pred/meas | "
        "terms at the peak (predicted) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for q in points:
        meas, pred = q.measured_max, q.predicted_max
        ratio = f"{pred / meas:.3f}" if meas and pred else "-"
        lines.append(
            f"| `{q.config}` | {q.tp} | {q.batch} | {q.prompt_tokens} | {q.tokens} | {q.status} | "
            f"{size(meas)} | {size(pred)} | {ratio} | {terms_cell(q)} |"
        )
    lines += [""] + fragmented_lines(points)
    return "\n".join(lines + fit_lines(capa.largest_batches(inputs.rows, points)) + [""])


def fragmented_lines(points: List[capa.PointRow]) -> List[str]:
    """The points that ran out of memory with room left under the cap: fragmentation, not the total, failed them."""
    out = []
    for q in points:
        f = capa.fragmentation(q.oom_message) if q.status == "oom" else None
        if f is None:
            continue
        out.append(
            f"- Batch {q.batch} x {q.prompt_tokens} (`{q.config}`, tp={q.tp}) ran out of memory with room left: "
            f"{size(f.allocated)} allocated + {size(f.requested)} requested = {size(f.needed)}, within the "
            f"{size(f.allowed)} allowed, while {size(f.unallocated)} sat reserved but unallocated in cached blocks "
            "too small for the request. The allocator's fragmentation failed it, not the total the memory model "
            "counts (a floor). `+trim.env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` lets the allocator grow "
            "one segment instead."
        )
    return out + [""] if out else []


def terms_cell(q: capa.PointRow) -> str:
    if not q.terms:
        return "-"
    return ", ".join(f"{k} {m.human(max(q.terms[k]))}" for k in TERMS if k in q.terms and max(q.terms[k]))


def fit_lines(fits: List[capa.Fit]) -> List[str]:
    """The largest batch per prompt length: predicted (a prediction) against the largest that ran."""
    if not fits:
        return []
    out = [
        "### Largest batch at each prompt length",
        "",
        "Predicted: the largest batch whose every rank's peak (weights' reserve + the terms above + the memory the "
        "run measured outside PyTorch's allocator) fits the budget's GPU in a budget search (budget.gpu_gib, one row "
        "per configuration over its jobs), else the GPU the run had (ranks sharing one GPU: each its share).",
        "",
        "| configuration | tp | prompt | new | predicted largest batch | largest that ran | smallest out of memory |",
        "|---|---|---|---|---|---|---|",
    ]
    for f in fits:
        predicted = f"0 ({f.cause})" if f.cause else str(f.predicted)
        out.append(
            f"| `{f.config}` | {f.tp} | {f.prompt_tokens} | {f.new_tokens} | {predicted} | "
            f"{'-' if f.ran is None else f.ran} | {'-' if f.out_of_memory is None else f.out_of_memory} |"
        )
    return out
