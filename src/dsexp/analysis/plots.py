"""PNG plots of a sweep: per-device memory vs tp (floor drawn in), host memory vs tp, and each job's memory over time
with its phases."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional, Tuple

from dsexp.analysis import measured as m
from dsexp.core import trace
from dsexp.core.series import column

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


HOST_LINES = (("host_rss", "host RSS", "-"), ("host_anon", "host anon (private)", "--"))
DEVICE_LINES = (
    ("nvml_device_used", "NVML device used", "-"),
    ("nvml_process_used", "NVML process used", "--"),
    ("gpu_reserved", "torch reserved", "-."),
    ("gpu_alloc", "torch allocated", ":"),
)
OTHER_PHASES = ("#8c564b", "#9467bd", "#e377c2", "#17becf", "#bcbd22")


def phase_color(kind: str) -> str:
    """start/load/init/generate as in the other plots; any other kind (a user's phase) a colour of its own."""
    if kind in PHASE_COLORS:
        return PHASE_COLORS[kind]
    return OTHER_PHASES[sum(map(ord, kind)) % len(OTHER_PHASES)]


def memory_timeline(result: Dict, path: Path, title: Optional[str] = None) -> Optional[Path]:
    """Memory against time, one row per rank (host; on a GPU also the device), the node's used memory below;
    each rank's phases as shaded bands (hatched: the phase a dead rank was in), on one time axis (seconds after
    the first rank's process started). None when no rank left a timeline or a series."""
    views = [v for v in trace.rank_views(result) if v["series"] or v["record"].get("timeline")]
    if not views:
        return None
    plt = _pyplot()
    origin = min(v["clock_t0"] for v in views)
    device = any("nvml_device_used" in (v["series"] or {}).get("fields", ()) for v in views)
    columns = [HOST_LINES] + ([DEVICE_LINES] if device else [])
    unit, scale = m.display_unit(_values_gib(views))
    fig, axes = plt.subplots(
        len(views) + 1,
        len(columns),
        figsize=(7.5 * len(columns) + 2.5, 1.2 + 2.1 * len(views) + 1.6),
        sharex=True,
        squeeze=False,
        gridspec_kw={"height_ratios": [3] * len(views) + [2]},
    )
    span = _time_span(views, origin)
    for row, view in enumerate(views):
        shift = view["clock_t0"] - origin
        for col, lines in enumerate(columns):
            ax = axes[row][col]
            _bands(ax, view, shift, span if col == 0 else None)
            for field, label, style in lines:
                pts = column(view["series"] or {}, field)
                ax.plot([shift + t for t, _ in pts], [v / m.GIB * scale for _, v in pts], style, lw=1.4, label=label)
            ax.set_ylabel(f"rank {view['rank']} ({unit})")
            ax.grid(True, alpha=0.3)
            ax.set_ylim(bottom=0)
            # ranks sharing a GPU: the device's figure holds every rank; the rank's own peak is its process's
            peak_field = "nvml_process_used" if col == 1 and m.shared_gpu(result) else lines[0][0]
            _mark_peak(ax, view, shift, peak_field, scale, unit, span)
    kinds = dict.fromkeys(s["kind"] for v in views for s in trace.phase_spans(v["record"], v["clock_t0"]))
    for col in range(len(columns)):
        ax = axes[0][col]
        ax.set_title("host memory of the rank" if col == 0 else "device memory of the rank", fontsize=10)
        handles, labels = ax.get_legend_handles_labels()
        handles += [plt.Rectangle((0, 0), 1, 1, color=phase_color(k), alpha=0.3) for k in kinds]
        ax.legend(handles, labels + list(kinds), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _node_row(axes[-1], views, origin, scale, unit)
    fig.suptitle(title or "Memory over time", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _values_gib(views) -> List[float]:
    return [v / m.GIB for view in views for row in (view["series"] or {}).get("points", ()) for v in row[1:] if v]


def _time_span(views, origin: float) -> Tuple[float, float]:
    ends = [
        view["clock_t0"] - origin + t
        for view in views
        for t in [p[0] for p in (view["series"] or {}).get("points", ())[-1:]]
        + [s["t1"] for s in trace.phase_spans(view["record"], view["clock_t0"])]
    ]
    return 0.0, max(ends, default=1.0) or 1.0


def _bands(ax, view: Dict, shift: float, span: Optional[Tuple[float, float]]) -> None:
    """The rank's phases, shaded; named (span given) where the band is wide enough for its name."""
    for s in trace.phase_spans(view["record"], view["clock_t0"]):
        color = phase_color(s["kind"])
        x0, x1 = shift + s["t0"], shift + s["t1"]
        ax.axvspan(x0, x1, color=color, alpha=0.18, lw=0, hatch="//" if s["partial"] else None)
        if span and (x1 - x0) >= 0.07 * (span[1] - span[0]):
            name = s["key"] + (" (did not end)" if s["partial"] else "")
            ax.text(x0, 1.0, " " + name, transform=ax.get_xaxis_transform(), fontsize=8, va="top", color=color)


def phase_at(view: Dict, t: float) -> str:
    """The phase a time falls in, else the one it follows ("after load"), else "before start"."""
    spans = trace.phase_spans(view["record"], view["clock_t0"])
    inside = next((s["key"] for s in spans if s["t0"] < t <= s["t1"]), None)
    if inside:
        return inside
    before = [s for s in spans if s["t1"] < t]
    return f"after {before[-1]['key']}" if before else "before the first phase"


def _mark_peak(ax, view: Dict, shift: float, field: str, scale: float, unit: str, span) -> None:
    """The rank's highest reading of `field`, and the phase it fell in (placed inwards near the right edge)."""
    pts = column(view["series"] or {}, field)
    if not pts:
        return
    t, v = max(pts, key=lambda p: p[1])
    x, y = shift + t, v / m.GIB * scale
    right = x > span[0] + 0.7 * (span[1] - span[0])
    ax.plot([x], [y], "o", color="black", ms=4)
    ax.annotate(
        f"peak {y:.3g} {unit} ({phase_at(view, t)})",
        (x, y),
        fontsize=8,
        xytext=(-6 if right else 6, -12),
        textcoords="offset points",
        ha="right" if right else "left",
    )


def _node_row(axes, views, origin: float, scale: float, unit: str) -> None:
    """The node's used memory (total - available: every process on the machine) as each rank read it."""
    for ax in axes[1:]:
        ax.axis("off")
    ax = axes[0]
    for view in views:
        pts = column(view["series"] or {}, "node_used")
        shift = view["clock_t0"] - origin
        xs, ys = [shift + t for t, _ in pts], [v / m.GIB * scale for _, v in pts]
        ax.plot(xs, ys, lw=1.0, label=f"read by rank {view['rank']}")
    ax.set_ylabel(f"node used ({unit})")
    ax.set_xlabel("seconds since the job's first rank started")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)


# (configuration, tp) -> {"measured": [(tokens B x L, GiB)], "oom": [...], "predicted L=<L>": [...] per prompt length}
TokenSeries = Dict[Tuple[str, int], Dict[str, List[Tuple[int, float]]]]
LENGTH_STYLES = ("--", ":", "-.", (0, (5, 1)), (0, (3, 1, 1, 1, 1, 1)))


def memory_vs_tokens(series: TokenSeries, on_gpu: bool, path: Path) -> Path:
    """Memory above the weights per rank against the prefill's tokens (B x L), both axes logarithmic: measured
    points over the memory model's lines (one per prompt length, the batch growing along it), one colour per
    configuration and tp; a cross where a point ran out of memory, at the model's figure for it."""
    plt = _pyplot()
    from matplotlib.lines import Line2D

    fig, ax = plt.subplots(figsize=(10, 5.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    unit, k = m.display_unit(v for s in series.values() for pts in s.values() for _, v in pts)
    lengths = sorted({key for s in series.values() for key in s if key.startswith("predicted")}, key=_length_of)
    for i, ((config, tp), s) in enumerate(sorted(series.items())):
        c = colors[i % len(colors)]
        for j, key in enumerate(lengths):
            pred = sorted(s.get(key, []))
            if pred:  # a line of one point is no line: a dash marks it
                style = dict(marker="_", ms=14, mew=1.5) if len(pred) == 1 else {}
                xs, ys = [t for t, _ in pred], [v * k for _, v in pred]
                ax.plot(xs, ys, ls=LENGTH_STYLES[j % 5], color=c, lw=1.3, **style)
        pts = sorted(s.get("measured", []))
        if pts:
            ax.plot([t for t, _ in pts], [v * k for _, v in pts], "o", color=c, label=f"{config} tp={tp}")
        oom = sorted(s.get("oom", []))
        if oom:
            ax.plot([t for t, _ in oom], [v * k for _, v in oom], "x", color=c, ms=9, mew=2)
    for j, key in enumerate(lengths):
        ax.add_line(Line2D([], [], ls=LENGTH_STYLES[j % 5], color="gray", label=f"memory model, {key[10:]}"))
    if any(s.get("oom") for s in series.values()):
        ax.add_line(Line2D([], [], ls="", marker="x", color="gray", label="out of memory (at the model's figure)"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("tokens of the prefill (batch x prompt tokens)")
    what = "GPU allocated peak above the weights" if on_gpu else "KV cache (CPU: the countable part)"
    ax.set_ylabel(f"{unit} per rank: {what}")
    ax.set_title("Memory above the weights per rank against tokens")
    ax.grid(True, alpha=0.3)
    _legend_right(ax)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _length_of(key: str) -> int:
    """ "predicted L=2048" -> 2048."""
    return int(key.rpartition("=")[2])


# (configuration, tp, prompt tokens) -> [(batch, tokens/s, TPOT p50 s or None)]
LatencySeries = Dict[Tuple[str, int, int], List[Tuple[int, float, Optional[float]]]]


def latency_vs_batch(series: LatencySeries, path: Path) -> Path:
    """Generated tokens/s and the time per output token (p50) against the batch, one line per configuration, tp and
    prompt length."""
    plt = _pyplot()
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    for (config, tp, length), pts in sorted(series.items()):
        pts = sorted(pts)
        label = f"{config} tp={tp} L={length}"
        left.plot([b for b, _, _ in pts], [r for _, r, _ in pts], "o-", label=label)
        timed = [(b, t) for b, _, t in pts if t is not None]
        right.plot([b for b, _ in timed], [t * 1000 for _, t in timed], "o-", label=label)
    for ax, ylabel in ((left, "generated tokens/s (every sequence)"), (right, "time per output token, p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
    _legend_right(right)
    fig.suptitle("Latency against batch")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
