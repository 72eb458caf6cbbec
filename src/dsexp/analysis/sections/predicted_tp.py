"""The "predicted" section: each configuration at the tp values the sweep ran (measured) and at those it did not
(the memory model, anchored on the largest tp that completed; dsexp.analysis.matrix.extrapolate)."""

from __future__ import annotations

from typing import List

from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Extrapolated, Row
from dsexp.analysis.sections.common import ReportInputs, num, weights_unit

NAME = "predicted"


def render(inputs: ReportInputs) -> str:
    table = extrapolation_table(inputs.extra, inputs.gpu, inputs.rows)
    return "\n".join(["## Predicted at tp values not run", "", table, ""])


def extrapolation_table(extra: List[Extrapolated], gpu: bool, rows: List[Row]) -> str:
    wu, ws = weights_unit(rows)
    header = (
        ["configuration", "tp", "source"]
        + (["per-GPU peak (GiB)"] if gpu else [])
        + [f"weights per {'GPU' if gpu else 'rank'} ({wu})", "host peak / rank (GiB)", "node host peak (GiB)"]
    )
    body = [
        [e.strategy, e.tp, "measured" if e.measured else (e.note or "predicted")]
        + ([num(e.per_device_gib)] if gpu else [])
        + [num(e.weights_gib, 2, ws), num(e.host_peak_gib), num(e.node_host_peak_gib)]
        for e in extra
    ]
    return md_table(header, body, [False, True, False] + [True] * (len(header) - 3))
