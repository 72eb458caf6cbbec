"""What every section of the report reads (`ReportInputs`: the sweep's rows, the memory model at tp values not run,
the plots written) and the cell formats its tables share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from dsexp.analysis import measured as m
from dsexp.analysis.matrix import Extrapolated, Row
from dsexp.core.result import JobRecord

PLOTS = "plots"  # the report's folder of plots, next to summary.md


@dataclass(frozen=True)
class ReportInputs:
    """The sweep as the sections see it: one row per configuration and tp, the predictions at tp values not run,
    the plots of the sweep ({name: file}) and each run's memory over time ({row index: file})."""

    rows: List[Row]
    extra: List[Extrapolated] = field(default_factory=list)
    figures: Dict[str, Path] = field(default_factory=dict)
    memory: Dict[int, Path] = field(default_factory=dict)
    search: Optional[Dict[str, Any]] = None  # a budget search's state: <sweep>/budget.json (analysis.budget_runs)

    @property
    def gpu(self) -> bool:
        return on_gpu(self.rows)


def on_gpu(rows: Sequence[Row]) -> bool:
    """Any run of the sweep on GPUs: the tables then show per-GPU figures."""
    return any(r.record.on_gpu for r in rows)


def size(v: Optional[float]) -> str:
    """Bytes as a table cell or a sentence says them, in the unit that suits them (GiB, or MiB/KiB for tiny CPU
    models); "-" where there is no figure."""
    return "-" if v is None else m.human(v)


def num(v: Optional[float], nd: int = 2, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{nd}f}"


def weights_unit(rows: List[Row]) -> tuple:
    """(unit, scale) for the weights columns: MiB when every figure is below 1 GiB (tiny CPU models), else GiB."""
    return m.display_unit(v for r in rows for v in (r.values()["gpu_weights_gib"], r.values()["pred_weights_gib"]))


def correct_cell(v: Dict[str, Any]) -> str:
    """A row's correctness verdict with its logits' relative error: "yes (5.0e-03)", "**NO** (2.0e-01)", "-"."""
    if v["correct"] is None:
        return "-"
    err = f" ({v['logits_rel_err']:.1e})" if v["logits_rel_err"] is not None else ""
    return ("yes" if v["correct"] else "**NO**") + err


def ranks_cell(vals: Sequence[float], scale: float) -> str:
    """Bytes per rank in the table's unit: "0.38 / 0.38"."""
    return " / ".join(f"{v / m.GIB * scale:.2f}" for v in vals) if vals else "-"


def status_word(result: m.Result) -> str:
    """A run's status for a heading or a plot's title: "ok", or "failed: <cause>"."""
    job = JobRecord.of(result)
    return "ok" if job.ok else f"failed: {job.cause or job.status}"
