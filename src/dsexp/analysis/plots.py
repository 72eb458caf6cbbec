"""PNG plots of a sweep: per-device memory vs tp (floor drawn in), host memory vs tp, one run's phase timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from dsexp.analysis import measured as m

Series = Dict[str, Dict[str, List[Tuple[int, float]]]]  # strategy -> {"measured": [(tp, GiB)], "predicted": [...]}
PHASE_COLORS = {"start": "#9e9e9e", "load": "#1f77b4", "init": "#ff7f0e", "generate": "#2ca02c"}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _unit(series: Series) -> Tuple[str, float]:
    return m.display_unit(v for s in series.values() for pts in s.values() for _, v in pts)


def _lines(ax, series: Series, scale: float, measured_key: str, predicted_key: str, predicted_label: str) -> None:
    plt = _pyplot()
    colors = (
        plt.rcParams["axes.prop_cycle"].by_key()["color"]
        if len(series) <= 10
        else [plt.get_cmap("tab20")(i) for i in range(20)]
    )  # more lines than the default cycle: no colour twice
    for i, (strategy, s) in enumerate(sorted(series.items())):
        c = colors[i % len(colors)]
        pts = sorted(p for p in s.get(measured_key, []) if p[1] is not None)
        if pts:
            ax.plot([t for t, _ in pts], [v * scale for _, v in pts], "o-", color=c, label=strategy, lw=2)
        pred = sorted(p for p in s.get(predicted_key, []) if p[1] is not None)
        if pred:
            ax.plot([t for t, _ in pred], [v * scale for _, v in pred], "--", color=c, lw=1.3, marker="x")
    from matplotlib.lines import Line2D

    ax.add_line(Line2D([], [], ls="--", marker="x", color="gray", label=f"{predicted_label} (dashed, same colour)"))
    tps = sorted({t for s in series.values() for pts in s.values() for t, v in pts if v is not None})
    if tps:
        ax.set_xscale("log", base=2)
        ax.set_xticks(tps)
        ax.set_xticklabels([str(t) for t in tps])
        ax.set_xlim(tps[0] / 1.25, tps[-1] * 1.25)
    ax.set_xlabel("tensor-parallel size tp (ranks)")
    top = max((v * scale for s in series.values() for pts in s.values() for _, v in pts if v is not None), default=1)
    ax.set_ylim(0, top * 1.15)
    ax.grid(True, alpha=0.3)


def _legend_right(ax) -> None:
    """Outside the axes, on the right: with a dozen configurations a legend inside hides the lines."""
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


def per_device_vs_tp(series: Series, on_gpu: bool, path: Path) -> Path:
    plt = _pyplot()
    unit, scale = _unit(series)
    fig, ax = plt.subplots(figsize=(13, 5.5))
    floor_label = "predicted floor: weights + KV + context" if on_gpu else "predicted weights"
    _lines(ax, series, scale, "measured", "predicted", floor_label)
    if on_gpu:
        ax.set_ylabel(f"per-GPU peak ({unit}, max over ranks)")
        ax.set_title("Per-GPU memory vs tp: measured peak (solid) and predicted floor (dashed)")
    else:
        ax.set_ylabel(f"device-resident weights per rank ({unit}, max over ranks)")
        ax.set_title(
            "Weights per rank vs tp, CPU run (the rank's device is the host)\nmeasured (solid) and predicted (dashed)"
        )
    _legend_right(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def host_vs_tp(per_rank: Series, node: Series, path: Path) -> Path:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 1, figsize=(13, 9))
    for ax, series, what in ((axes[0], per_rank, "host peak per rank"), (axes[1], node, "node host peak")):
        unit, scale = _unit(series)
        _lines(ax, series, scale, "measured", "predicted", "predicted")
        ax.set_ylabel(f"{what} ({unit}{', max over ranks' if 'rank' in what else ', whole machine'})")
        ax.set_title(f"{what.capitalize()} vs tp: measured (solid), predicted (dashed)")
        _legend_right(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def timeline(result: Dict, path: Path, title: Optional[str] = None) -> Optional[Path]:
    """One bar per rank, one segment per phase (seconds since the rank's process started), host peak in each."""
    ranks = [r for r in m.ranks(result) if r.get("timeline")]
    if not ranks:
        return None
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 1.2 + 0.9 * len(ranks)))
    for i, rk in enumerate(ranks):
        for seg in rk["timeline"]:
            ph, t0, t1 = seg["phase"], seg["t0"], seg["t1"]
            ax.broken_barh([(t0, t1 - t0)], (i - 0.35, 0.7), color=PHASE_COLORS.get(ph, "#777777"))
            peak = m.phase(rk, ph).get("peaks", {}).get("host_rss_peak")
            if peak is not None and (t1 - t0) > 0.06 * _span(ranks):
                ax.text((t0 + t1) / 2, i, f"{ph}\n{m.human(peak)}", ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels([f"rank {rk.get('rank', i)}" for i, rk in enumerate(ranks)])
    ax.set_xlabel("time since the rank's process started (s)")
    ax.set_title(f"{title or 'Phase timeline'}\n(each segment: phase and the rank's host RSS peak in it)", fontsize=10)
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in PHASE_COLORS.values()]
    ax.legend(handles, list(PHASE_COLORS), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(True, axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _span(ranks: Sequence[Dict]) -> float:
    return max((s["t1"] for rk in ranks for s in rk["timeline"]), default=1.0) or 1.0
