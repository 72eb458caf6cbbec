"""The "weights" section: the weights on each rank's device after init, predicted vs measured, what the memory
model keeps whole on every rank, and the diagnosis of each run whose weights were not placed as predicted."""

from __future__ import annotations

from typing import List

from dsexp.analysis import measured as m
from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Row
from dsexp.analysis.sections.common import ReportInputs, ranks_cell, weights_unit

NAME = "weights"
WITHIN = 0.02  # measured within 2% of the prediction: "as predicted"
OFF_PCT = 2  # a row whose weights are more than 2% off gets its findings listed under the table
PLACEMENT_FINDINGS = ("nothing_sharded", "weights_differ")


def render(inputs: ReportInputs) -> str:
    lines = ["## Weights per rank: predicted vs measured", "", weights_table(inputs.rows), ""]
    return "\n".join(lines + _differences(inputs.rows))


def weights_table(rows: List[Row]) -> str:
    """Per-rank weights, predicted vs measured, and what the model keeps whole on every rank."""
    wu, ws = weights_unit(rows)
    header = [
        "configuration",
        "tp",
        f"measured per rank ({wu})",
        f"predicted per rank ({wu})",
        "max Δ",
        "within 2%",
        "replicated on every rank (predicted)",
    ]
    body = [_line(r, ws) for r in rows]
    return md_table(header, body, [False, True, True, True, True, False, False])


def _line(r: Row, ws: float) -> list:
    meas, p = m.weights_per_rank(r.record), r.prediction
    if p is None:
        return [r.strategy, r.tp, ranks_cell(meas, ws), "-", "-", "-", r.model_error or ""]
    err = max((abs(a - b) / b for a, b in zip(meas, p.weights) if b), default=None) if meas else None
    rep = ", ".join(f"{n} {m.human(b)}" for n, b in list(p.replicated().items())[:3]) if p.tp > 1 else "(tp=1: all)"
    return [
        r.strategy,
        r.tp,
        ranks_cell(meas, ws),
        ranks_cell(p.weights, ws),
        "-" if err is None else f"{100 * err:.2f}%",
        "-" if err is None else ("yes" if err <= WITHIN else "**no**"),
        rep,
    ]


def _differences(rows: List[Row]) -> List[str]:
    """The findings of each run whose weights are more than 2% off the prediction."""
    off = [r for r in rows if abs(r.values()["weights_err_pct"] or 0) > OFF_PCT]
    if not off:
        return []
    items = [f"- `{r.label}`: " + "; ".join(f.text for f in r.findings if f.code in PLACEMENT_FINDINGS) for r in off]
    return ["Differences where the weights were not placed as predicted:", ""] + items + [""]
