"""The "plots" section: the sweep's plots (per-device and host memory against tp), as images in plots/."""

from __future__ import annotations

from dsexp.analysis.sections.common import PLOTS, ReportInputs

NAME = "plots"


def render(inputs: ReportInputs) -> str:
    images = [f"![{k}]({PLOTS}/{p.name})" for k, p in inputs.figures.items()]
    return "\n".join(["## Plots", ""] + images + [""])
