"""The sweep report: summary.md (its sections, each rendered by a module of dsexp.analysis.sections; tables meant
to be pasted into docs as they are), summary.csv, plots/, written into a folder. Attaching it to the sweep's MLflow
parent run is `dsexp.tracking.upload`'s job: it is handed in as `mlflow` (an object with `view(rows)` and
`attach(out, rows)`), so analysis never imports MLflow."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from dsexp.analysis import measured as m
from dsexp.analysis import plots, workload_points
from dsexp.analysis.matrix import Extrapolated, Row, build_rows, extrapolate
from dsexp.analysis.memory import predict
from dsexp.analysis.sections import render_sections
from dsexp.analysis.sections.common import PLOTS, ReportInputs, on_gpu, status_word
from dsexp.analysis.sources import results_from_dir

SUMMARY_MD, SUMMARY_CSV = "summary.md", "summary.csv"
HEADING = "# dsexp sweep summary"  # summary.md's first line: what marks a file as a report of dsexp
FILES = {"per_device": "per_device_vs_tp.png", "host": "host_vs_tp.png"}


def memory_plot(index: int) -> str:
    """The file name of the n-th run's memory-over-time plot in plots/ (attached to its MLflow run as well)."""
    return f"memory_{index:02d}.png"


def write_report(
    sweep_dir: Path,
    results: Optional[Sequence[Dict[str, Any]]] = None,
    out_dir: Optional[Path] = None,
    source: Optional[str] = None,
    mlflow=None,
    search: Optional[Dict[str, Any]] = None,
) -> Optional[Dict[str, str]]:
    """Report on a sweep folder's results (or the given ones) into out_dir (default: the sweep folder), and hand
    it to `mlflow` if given (its `view(rows)` returns (parent run, UI route) for the summary's MLflow line).
    Returns the report's sections by name (markdown), None when there are no results. search: a budget search
    (default: the folder's budget.json)."""
    results, search = _sources(sweep_dir, results, search)
    out = Path(out_dir or sweep_dir)
    if not results and search is not None:  # a budget nothing meets: the answer is that, with no run
        return write_search_only(out, search, source or str(sweep_dir))
    if not results:
        print(f"dsexp report: no results under {sweep_dir}", file=sys.stderr)
        return None
    rows = build_rows(results)
    (out / PLOTS).mkdir(parents=True, exist_ok=True)
    extra = extrapolate(rows)
    figures = write_plots(rows, extra, out / PLOTS)
    figures.update(workload_points.write_plots(workload_points.point_rows(rows), out / PLOTS))
    memory = write_memory_plots(rows, out / PLOTS)
    parent, view = mlflow.view(rows) if mlflow else (None, None)
    parts = render_sections(ReportInputs(rows, extra, figures, memory, search))
    (out / SUMMARY_MD).write_text(render_markdown(rows, parts, source or str(sweep_dir), parent, view))
    frame(rows).to_csv(out / SUMMARY_CSV, index=False)
    if mlflow:
        mlflow.attach(out, rows)
    print(
        f"dsexp report: {out / SUMMARY_MD}" + (f"\n             MLflow comparison view: {view}" if view else ""),
        file=sys.stderr,
    )
    return parts


def text_report(
    sweep_dir: Path,
    source: str,
    results: Optional[Sequence[Dict[str, Any]]] = None,
    search: Optional[Dict[str, Any]] = None,
) -> str:
    """summary.md as write_report writes it from the same sources, with nothing written: no plot is drawn, so the
    plot and memory-over-time sections (lists of plot files) are left out. Seconds where drawing the plots takes a
    minute: what a check of a committed report reads (dsexp.analysis.committed)."""
    results, search = _sources(sweep_dir, results, search)
    rows = build_rows(results) if results else []
    return render_markdown(rows, _text_parts(rows, search), source)


def text_sections(
    sweep_dir: Path, results: Optional[Sequence[Dict[str, Any]]] = None, search: Optional[Dict[str, Any]] = None
) -> Dict[str, str]:
    """text_report's sections by name."""
    results, search = _sources(sweep_dir, results, search)
    return _text_parts(build_rows(results) if results else [], search)


def _text_parts(rows: List[Row], search: Optional[Dict[str, Any]]) -> Dict[str, str]:
    from dsexp.analysis.sections import budget_answer, memory_over_time, plot_links

    if not rows:
        return {budget_answer.NAME: budget_answer.render(ReportInputs([], search=search))} if search else {}
    parts = render_sections(ReportInputs(rows, extrapolate(rows), search=search))
    return {k: v for k, v in parts.items() if k not in (plot_links.NAME, memory_over_time.NAME)}


def _sources(sweep_dir: Path, results, search) -> tuple:
    """(results, search): those given, else the folder's result.json files and its budget.json."""
    from dsexp.analysis.budget_runs import read_search

    results = list(results) if results is not None else results_from_dir(sweep_dir)
    return results, search if search is not None else read_search(sweep_dir)


def write_search_only(out: Path, search: Dict[str, Any], source: str) -> Dict[str, str]:
    """summary.md of a budget search that launched nothing: its budget section alone."""
    parts = _text_parts([], search)
    out.mkdir(parents=True, exist_ok=True)
    (out / SUMMARY_MD).write_text(render_markdown([], parts, source))
    print(f"dsexp report: {out / SUMMARY_MD}", file=sys.stderr)
    return parts


def frame(rows: List[Row]):
    """summary.csv's table: one line per row, its values (dsexp.analysis.matrix.Row.values) as columns."""
    import pandas as pd

    return pd.DataFrame([r.values() for r in rows])


def render_markdown(
    rows: List[Row],
    parts: Dict[str, str],
    source: str,
    parent: Optional[Dict[str, Any]] = None,
    view: Optional[str] = None,
) -> str:
    """summary.md: its head (the source, the runs, the device, the command that writes it again), then the parts;
    a budget search that launched nothing has no runs, and no device."""
    gpu = on_gpu(rows)
    devices = sorted({str(r.values()["device"]) for r in rows})
    device = f" · device: {', '.join(devices)}" if rows else ""
    out = [
        HEADING,
        "",
        f"Source: `{source}` · {len(rows)} runs{device} · regenerate with `python -m dsexp.report {source}`",
        "",
    ]
    if parent:
        out += [
            f"MLflow: experiment `{parent['experiment']}`, sweep run `{parent['run_id']}` (this report is in its "
            f"artifacts under `report/`); side-by-side view of the runs: `{view}` in the MLflow UI "
            f"(`make ui`).",
            "",
        ]
    if rows and not gpu:
        out += [
            "CPU runs: there is no GPU; per-device figures are the weights resident on each rank, whose "
            "device is the host. Host figures include each rank's Python runtime.",
            "",
        ]
    return "\n".join(out + list(parts.values()))


# --- plots ---------------------------------------------------------------------------------------


def write_plots(rows: List[Row], extra: List[Extrapolated], folder: Path) -> Dict[str, Path]:
    gpu = on_gpu(rows)
    per_dev: plots.Series = {}
    host: plots.Series = {}
    node: plots.Series = {}
    for r in rows:
        if r.result.get("status") != "ok":  # a failed run's memory is where it stopped, not the configuration's
            continue
        per_dev.setdefault(r.strategy, {"measured": [], "predicted": []})["measured"].append(
            (r.tp, m.per_device_gib(r.result))
        )
        host.setdefault(r.strategy, {"measured": [], "predicted": []})["measured"].append(
            (r.tp, m.headline(r.result, "host_peak_gib"))
        )
        node.setdefault(r.strategy, {"measured": [], "predicted": []})["measured"].append(
            (r.tp, m.headline(r.result, "node_host_peak_gib"))
        )
    for strategy, pts in _floors(rows, extra, gpu).items():
        if strategy in per_dev:
            per_dev[strategy]["predicted"] = pts
    for e in extra:
        if not e.measured and e.strategy in host:
            if e.host_peak_gib is not None:
                host[e.strategy]["predicted"].append((e.tp, e.host_peak_gib))
            if e.node_host_peak_gib is not None:
                node[e.strategy]["predicted"].append((e.tp, e.node_host_peak_gib))
    for series in (host, node):  # predicted lines start at the measured point they are calibrated on
        for s in series.values():
            if s["predicted"] and s["measured"]:
                s["predicted"].insert(0, max(s["measured"], key=lambda p: p[0]))
    return {
        "per_device": plots.per_device_vs_tp(per_dev, gpu, folder / FILES["per_device"]),
        "host": plots.host_vs_tp(host, node, folder / FILES["host"]),
    }


def write_memory_plots(rows: List[Row], folder: Path) -> Dict[int, Path]:
    """{row index: its memory-over-time plot}, for every run whose ranks left a timeline or a series."""
    out = {}
    for i, r in enumerate(rows):
        title = f"Memory over time: {r.label} ({status_word(r.result)})"
        path = _safe(lambda: plots.memory_timeline(r.result, folder / memory_plot(i), title))
        if path is not None:
            out[i] = path
    return out


def _floors(rows: List[Row], extra: List[Extrapolated], gpu: bool) -> Dict[str, list]:
    """Per configuration: the predicted floor (GPU) or weights (CPU) at every tp run or extrapolated."""
    out: Dict[str, list] = {}
    for strategy in dict.fromkeys(r.strategy for r in rows):
        base = next((r for r in sorted(rows, key=lambda r: -r.tp) if r.strategy == strategy and r.prediction), None)
        if base is None:
            continue
        tps = sorted(
            {r.tp for r in rows if r.strategy == strategy}
            | {e.tp for e in extra if e.strategy == strategy and e.weights_gib is not None}
        )
        pts = []
        for tp in tps:
            p = base.prediction if tp == base.tp else _safe(lambda: predict(base.result, tp))
            if p is not None and not p.error and (p.overhead is not None or not gpu):
                pts.append((tp, (p.floor() if gpu else p.weights_max) / m.GIB))
        out[strategy] = pts
    return out


def _safe(fn: Callable):
    try:
        return fn()
    except Exception:
        return None
