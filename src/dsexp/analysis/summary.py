"""The sweep report: summary.md (tables meant to be pasted into docs as they are), summary.csv, plots/,
written into a folder. Attaching it to the sweep's MLflow parent run is `dsexp.tracking.upload`'s job: it is
handed in as `mlflow` (an object with `view(rows)` and `attach(out, rows)`), so analysis never imports MLflow."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from dsexp.analysis import measured as m
from dsexp.analysis import plots
from dsexp.analysis.diagnosis import floor_terms
from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Extrapolated, Row, build_rows, extrapolate, main_model, recommend, untrimmed_label
from dsexp.analysis.memory import predict
from dsexp.analysis.script_report import scripts_section
from dsexp.analysis.sources import results_from_dir
from dsexp.core.schema import stack_label
from dsexp.trims import active as trims_active

SUMMARY_MD, SUMMARY_CSV, PLOTS = "summary.md", "summary.csv", "plots"
FILES = {"per_device": "per_device_vs_tp.png", "host": "host_vs_tp.png"}
TRACE_NOTE = (
    "Each job's folder also holds `trace.json`, the same curves and phases as a Chrome trace (a track per rank, "
    "phases as slices, memory as counters): open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing; "
    "it is in the job's MLflow run too."
)


def memory_plot(index: int) -> str:
    """The file name of the n-th run's memory-over-time plot in plots/ (attached to its MLflow run as well)."""
    return f"memory_{index:02d}.png"


def write_report(
    sweep_dir: Path,
    results: Optional[Sequence[Dict[str, Any]]] = None,
    out_dir: Optional[Path] = None,
    source: Optional[str] = None,
    mlflow=None,
) -> Optional[Dict[str, str]]:
    """Report on a sweep folder's results (or the given ones) into out_dir (default: the sweep folder), and hand
    it to `mlflow` if given (its `view(rows)` returns (parent run, UI route) for the summary's MLflow line).
    Returns the report's sections by name (markdown), None when there are no results."""
    results = list(results) if results is not None else results_from_dir(sweep_dir)
    if not results:
        print(f"dsexp report: no results under {sweep_dir}", file=sys.stderr)
        return None
    out = Path(out_dir or sweep_dir)
    rows = build_rows(results)
    (out / PLOTS).mkdir(parents=True, exist_ok=True)
    extra = extrapolate(rows)
    figures = write_plots(rows, extra, out / PLOTS)
    memory = write_memory_plots(rows, out / PLOTS)
    parent, view = mlflow.view(rows) if mlflow else (None, None)
    parts = sections(rows, extra, figures, memory)
    (out / SUMMARY_MD).write_text(render_markdown(rows, parts, source or str(sweep_dir), parent, view))
    frame(rows).to_csv(out / SUMMARY_CSV, index=False)
    if mlflow:
        mlflow.attach(out, rows)
    print(
        f"dsexp report: {out / SUMMARY_MD}" + (f"\n             MLflow comparison view: {view}" if view else ""),
        file=sys.stderr,
    )
    return parts


# --- tables --------------------------------------------------------------------------------------


def frame(rows: List[Row]):
    import pandas as pd

    return pd.DataFrame([r.values() for r in rows])


def _num(v: Optional[float], nd: int = 2, scale: float = 1.0) -> str:
    return "-" if v is None else f"{v * scale:.{nd}f}"


def _weights_unit(rows: List[Row]) -> tuple:
    return m.display_unit(v for r in rows for v in (r.values()["gpu_weights_gib"], r.values()["pred_weights_gib"]))


def _correct(v: Dict[str, Any]) -> str:
    if v["correct"] is None:
        return "-"
    err = f" ({v['logits_rel_err']:.1e})" if v["logits_rel_err"] is not None else ""
    return ("yes" if v["correct"] else "**NO**") + err


def stacks_section(rows: List[Row]) -> List[str]:
    """The same configuration on each software stack of the sweep, side by side (empty with one stack)."""
    stacks = sorted({stack_label(r.config.get("stack") or {}) for r in rows})
    if len(stacks) < 2:
        return []
    wu, ws = _weights_unit(rows)
    by_config: Dict[tuple, List[Row]] = {}
    for r in rows:
        by_config.setdefault((r.strategy.split("@")[0], r.tp), []).append(r)
    body, notes = [], []
    for (config, tp), group in sorted(by_config.items()):
        if len(group) < 2:
            continue
        for r in sorted(group, key=lambda r: stack_label(r.config.get("stack") or {})):
            v, versions = r.values(), ((r.result.get("software") or {}).get("versions") or {})
            body.append(
                [
                    config,
                    tp,
                    stack_label(r.config.get("stack") or {}),
                    f"{versions.get('transformers', '-')} / {versions.get('deepspeed', '-')}",
                    v["status"],
                    _correct(v),
                    _num(v["gpu_weights_gib"], 2, ws),
                    _num(v["host_anon_peak_gib"]),
                    _num(v["node_host_peak_gib"]),
                    _num(v["load_s"]),
                    _num(v["tokens_per_s"], 1),
                ]
            )
        notes += _stack_differences(config, tp, group)
    if not body:
        return []
    header = [
        "configuration",
        "tp",
        "stack",
        "transformers / deepspeed",
        "status",
        "correct (rel. err)",
        f"weights per rank ({wu})",
        "host anon / rank (GiB)",
        "node host peak (GiB)",
        "load (s)",
        "tokens/s",
    ]
    right = [False, True, False, False, False, False, True, True, True, True, True]
    return ["## Software stacks", "", md_table(header, body, right), ""] + [f"- {n}" for n in notes] + [""]


def _stack_differences(config: str, tp: int, group: List[Row]) -> List[str]:
    """One line per figure that differs by more than 10% between the stacks of one configuration."""
    out = []
    for key, what in (
        ("host_anon_peak_gib", "private host memory per rank"),
        ("gpu_weights_gib", "weights per rank"),
        ("node_host_peak_gib", "node host peak"),
    ):
        vals = {stack_label(r.config.get("stack") or {}): r.values()[key] for r in group if r.values()[key]}
        if len(vals) > 1 and max(vals.values()) > 1.1 * min(vals.values()):
            out.append(f"`{config}` at tp={tp}: {what} " + ", ".join(f"{v:.2f} GiB on {s}" for s, v in vals.items()))
    statuses = {stack_label(r.config.get("stack") or {}): r.values()["status"] for r in group}
    if len(set(statuses.values())) > 1:
        out.append(f"`{config}` at tp={tp}: " + ", ".join(f"{st} on {s}" for s, st in statuses.items()))
    return out


def matrix_table(rows: List[Row]) -> str:
    wu, ws = _weights_unit(rows)
    gpu = any(m.on_gpu(r.result) for r in rows)
    header = (
        ["configuration", "tp", "status", "correct (rel. err)"]
        + (["per-GPU peak (GiB)"] if gpu else [])
        + [
            f"weights per {'GPU' if gpu else 'rank'} ({wu})",
            f"predicted ({wu})",
            "Δ",
            "host peak / rank (GiB)",
            "host anon / rank (GiB)",
            "node host peak (GiB)",
            "load (s)",
            "init (s)",
            "generate (s)",
            "tokens/s",
        ]
        + ([f"outside the allocator (GiB): {OUTSIDE_HEADER}"] if gpu else [])
    )
    body = []
    for r in rows:
        v = r.values()
        body.append(
            [v["config"], v["tp"], v["status"], _correct(v)]
            + ([_num(v["gpu_peak_gib"])] if gpu else [])
            + [
                _num(v["gpu_weights_gib"], 2, ws),
                _num(v["pred_weights_gib"], 2, ws),
                "-" if v["weights_err_pct"] is None else f"{v['weights_err_pct']:+.1f}%",
                _num(v["host_peak_gib"]),
                _num(v["host_anon_peak_gib"]),
                _num(v["node_host_peak_gib"]),
            ]
            + _speed_cells(r)
            + ([_outside_cell(v)] if gpu else [])
        )
    table = md_table(header, body, [False, True, False, False] + [True] * (len(header) - 4))
    if any(not m.speed_representative(r.result) for r in rows):
        table += f"\n\n{SHARED_GPU_NOTE}"
    return table


SHARED_GPU_NOTE = (
    "Times in parentheses: the ranks shared one GPU over gloo (launcher.gpus): their memory per rank is real, their "
    "times are not a multi-GPU machine's and are left out of every speed comparison. NCCL's own buffers: not "
    "measured (shared GPU)."
)


def _speed_cells(r: Row) -> List[str]:
    """load, init, generate seconds and tokens/s; in parentheses for a run whose ranks shared a GPU."""
    cells = [_num(m.raw_headline(r.result, k), 1 if k == "tokens_per_s" else 2) for k in m.SPEED]
    return cells if m.speed_representative(r.result) else [f"({c})" if c != "-" else c for c in cells]


OUTSIDE_HEADER = "context + comm + load/init + generate + device (+ unexplained)"


def _outside_cell(v: Dict[str, Any]) -> str:
    parts = [v[f"outside_{k}_gib"] for k in m.OUTSIDE_PARTS]
    if all(p is None for p in parts):
        return "-"
    left = v["outside_unexplained_gib"]
    return " + ".join(_num(p) for p in parts) + ("" if left is None else f" ({left:+.2f})")


# --- trims ---------------------------------------------------------------------------------------------------

SLOWER = 0.05  # a setting is recommended only where generate slows by less than this


@dataclass
class TrimEffect:
    """A trimmed run against the same configuration untrimmed at the same tp (None where the sweep has none)."""

    row: Row
    base: Optional[Row]
    weights: Optional[float]  # bytes per rank saved, measured (max over ranks)
    per_device: Optional[float]  # GiB saved: per-GPU peak on GPUs, weights on CPU runs
    outside: Optional[float]  # GiB saved outside the allocator
    speed: Optional[float]  # tokens/s trimmed / untrimmed

    @property
    def env_only(self) -> bool:
        return not trims_active(self.row.config.get("trim") or {})

    def verdict(self) -> str:
        if not m.passed(self.row.result):
            return "**not correct**" if self.row.result.get("status") == "ok" else "failed"
        if self.base is None or self.per_device is None:
            return "correct; no untrimmed run to compare"
        saves = self.per_device > 0 or (self.outside or 0) > 0
        if self.env_only and self.speed is not None and self.speed < 1 - SLOWER:
            return f"not recommended: generate {1 - self.speed:.0%} slower"
        if not self.env_only:
            return "correct, saves memory" if saves else "correct, no saving"
        return "recommended" if saves else "no saving"


def trim_effects(rows: List[Row]) -> List[TrimEffect]:
    by_label = {(r.strategy, r.tp): r for r in rows}
    out = []
    for r in rows:
        if not r.values()["trims"]:
            continue
        base = by_label.get((untrimmed_label(r.config), r.tp))
        if base is None or not m.completed(base.result) or not m.completed(r.result):
            out.append(TrimEffect(r, base, None, None, None, None))
            continue
        a, b = m.weights_per_rank(base.result), m.weights_per_rank(r.result)
        pa, pb = m.per_device_gib(base.result), m.per_device_gib(r.result)
        oa, ob = (m.outside_parts(x.result) for x in (base, r))
        ta, tb = m.headline(base.result, "tokens_per_s"), m.headline(r.result, "tokens_per_s")
        out.append(
            TrimEffect(
                r,
                base,
                max(a) - max(b) if a and b else None,
                pa - pb if pa is not None and pb is not None else None,
                (oa["outside"] - ob["outside"]) / m.GIB if oa and ob else None,
                tb / ta if ta and tb else None,
            )
        )
    return out


def trims_table(rows: List[Row]) -> Optional[str]:
    effects = trim_effects(rows)
    if not effects:
        return None
    wu, ws = _weights_unit(rows)
    gpu = any(m.on_gpu(r.result) for r in rows)
    what = "per-GPU peak (GiB)" if gpu else f"weights per rank ({wu})"
    header = (
        [
            "configuration",
            "tp",
            "trims",
            f"predicted per rank ({wu})",
            f"measured per rank ({wu})",
            "as predicted",
            f"weights saved per rank ({wu})",
        ]
        + ([f"{what} saved", "outside the allocator saved (GiB)"] if gpu else [])
        + ["correct (rel. err)", "tokens/s (x untrimmed)", "verdict"]
    )
    body = []
    for e in effects:
        r, v, p = e.row, e.row.values(), e.row.prediction
        meas = m.weights_per_rank(r.result)
        exact = (
            "-" if not (p and meas) else "exact" if list(meas) == list(p.weights) else f"{v['weights_err_pct']:+.1f}%"
        )
        exact = exact.replace("+0.0%", "<0.05%")
        body.append(
            [
                untrimmed_label(r.config),
                r.tp,
                v["trims"],
                _ranks(p.weights, ws) if p else "-",
                _ranks(meas, ws),
                exact,
                _num(None if e.weights is None else e.weights / m.GIB, 2, ws),
            ]
            + ([_num(e.per_device), _num(e.outside)] if gpu else [])
            + [
                _correct(v),
                _num(v["tokens_per_s"], 1) + ("" if e.speed is None else f" ({e.speed:.2f}x)"),
                e.verdict(),
            ]
        )
    return md_table(header, body, [False, True, False] + [True] * (len(header) - 6) + [False, True, False])


def trim_lines(rows: List[Row]) -> List[str]:
    """The recommendation's view of the trims: what the best trimmed run saves over the same one untrimmed, and
    which trim.env settings cut memory at generate slowed by less than 5%."""
    model = main_model(rows)
    effects = [e for e in trim_effects(rows) if (e.row.config.get("model") or {}).get("name") == model]
    if not effects:
        return []
    lines = []
    gpu = any(m.on_gpu(r.result) for r in rows)
    unit = "per GPU" if gpu else "per rank"
    model_trims = [e for e in effects if not e.env_only and e.per_device is not None and m.passed(e.row.result)]
    if model_trims:
        best = max(model_trims, key=lambda e: (e.per_device, e.row.tp))
        lines.append(
            f"Trimmed configurations are compared with the rest: `{best.row.label}` saves "
            f"{m.human(best.per_device * m.GIB)} {unit} over `{best.base.label}` "
            f"({m.human(m.per_device_gib(best.base.result) * m.GIB)} -> "
            f"{m.human(m.per_device_gib(best.row.result) * m.GIB)}), "
            f"tokens/s {_num(best.base.values()['tokens_per_s'], 1)} -> {_num(best.row.values()['tokens_per_s'], 1)}."
        )
    env = [e for e in effects if e.env_only and e.base is not None]
    good = [e for e in env if e.verdict() == "recommended"]
    bad = [e for e in env if e.verdict() != "recommended"]
    if good:
        lines.append(
            "trim.env settings that cut memory with generate slowed by less than 5%: "
            + "; ".join(f"`{e.row.values()['trims']}` at tp={e.row.tp}: {_saved(e, unit)}" for e in good)
            + "."
        )
    if bad:
        lines.append(
            "trim.env settings not recommended: "
            + "; ".join(f"`{e.row.values()['trims']}` at tp={e.row.tp}: {e.verdict()} ({_saved(e, unit)})" for e in bad)
            + "."
        )
    return lines


def _saved(e: TrimEffect, unit: str) -> str:
    speed = "" if e.speed is None else f", tokens/s x{e.speed:.2f}"
    return (
        f"{_num(e.per_device)} GiB {unit} saved, {_num(e.outside)} GiB of it outside the allocator{speed}"
        if e.per_device is not None
        else "no comparison"
    )


def weights_table(rows: List[Row]) -> str:
    """Per-rank weights, predicted vs measured, and what the model keeps whole on every rank."""
    wu, ws = _weights_unit(rows)
    header = [
        "configuration",
        "tp",
        f"measured per rank ({wu})",
        f"predicted per rank ({wu})",
        "max Δ",
        "within 2%",
        "replicated on every rank (predicted)",
    ]
    body = []
    for r in rows:
        meas, p = m.weights_per_rank(r.result), r.prediction
        if p is None:
            body.append([r.strategy, r.tp, _ranks(meas, ws), "-", "-", "-", r.model_error or ""])
            continue
        err = max((abs(a - b) / b for a, b in zip(meas, p.weights) if b), default=None) if meas else None
        rep = ", ".join(f"{n} {m.human(b)}" for n, b in list(p.replicated().items())[:3]) if p.tp > 1 else "(tp=1: all)"
        body.append(
            [
                r.strategy,
                r.tp,
                _ranks(meas, ws),
                _ranks(p.weights, ws),
                "-" if err is None else f"{100 * err:.2f}%",
                "-" if err is None else ("yes" if err <= 0.02 else "**no**"),
                rep,
            ]
        )
    return md_table(header, body, [False, True, True, True, True, False, False])


def _ranks(vals: Sequence[float], scale: float) -> str:
    return " / ".join(f"{v / m.GIB * scale:.2f}" for v in vals) if vals else "-"


def extrapolation_table(extra: List[Extrapolated], gpu: bool, rows: List[Row]) -> str:
    wu, ws = _weights_unit(rows)
    header = (
        ["configuration", "tp", "source"]
        + (["per-GPU peak (GiB)"] if gpu else [])
        + [f"weights per {'GPU' if gpu else 'rank'} ({wu})", "host peak / rank (GiB)", "node host peak (GiB)"]
    )
    body = [
        [e.strategy, e.tp, "measured" if e.measured else (e.note or "predicted")]
        + ([_num(e.per_device_gib)] if gpu else [])
        + [_num(e.weights_gib, 2, ws), _num(e.host_peak_gib), _num(e.node_host_peak_gib)]
        for e in extra
    ]
    return md_table(header, body, [False, True, False] + [True] * (len(header) - 3))


FLOOR_MARGIN = 0.05  # a recommended peak within 5% of the memory model's floor leaves nothing big unexplained


def recommendation(rows: List[Row], extra: List[Extrapolated]) -> List[str]:
    picks = recommend(rows)
    gpu = any(m.on_gpu(r.result) for r in rows)
    what = (
        "per-GPU peak" if gpu else "device-resident weights per rank (CPU run: no GPU, the rank's device is the host)"
    )
    best, plain = picks["per_device"], picks["per_device_no_offload"]
    if best is None:
        return ["No configuration passed the correctness check: nothing to recommend."]
    if plain is not None and plain.row is not best.row:
        # Offloading weights to the host trades speed and host memory for GPU memory: recommend the best
        # configuration that keeps its weights on the GPU, and show the offload one with what it costs.
        a, b = best.row.values(), plain.row.values()
        lines = [
            _pick_line(
                f"**Recommended (lowest {what} without offloading weights to the host, passed "
                "correctness; ties within 1% broken by host peak per rank)",
                plain,
                gpu,
                "**",
            ),
            _pick_line(f"Lowest {what} of all (weights offloaded to host memory)", best, gpu, ""),
            f"What the offload costs against the recommended configuration: host peak "
            f"{_num(a['host_peak_gib'])} vs {_num(b['host_peak_gib'])} GiB per rank, node "
            f"{_num(a['node_host_peak_gib'])} vs {_num(b['node_host_peak_gib'])} GiB, tokens/s "
            f"{_num(a['tokens_per_s'], 1)} vs {_num(b['tokens_per_s'], 1)}.",
        ]
    else:
        lines = [_pick_line(f"**Recommended (lowest {what} that passed correctness)", best, gpu, "**")]
    others = sorted({r.config.get("model", {}).get("name") for r in rows} - {main_model(rows)})
    if others:
        lines.insert(
            0,
            f"Runs of `{main_model(rows)}` compared; other models are left out of the recommendation "
            f"({', '.join(f'`{o}`' for o in others)}).",
        )
    for strategy in dict.fromkeys(pick.row.strategy for pick in (best, plain) if pick):
        ahead = [e for e in extra if e.strategy == strategy and not e.measured and e.per_device_gib is not None]
        if ahead:
            lines.append(
                f"Predicted for `{strategy}`: "
                + "; ".join(
                    f"tp={e.tp}: {m.human(e.per_device_gib * m.GIB)} per {'GPU' if gpu else 'rank'}, "
                    f"host {_num(e.host_peak_gib)} GiB per rank, node {_num(e.node_host_peak_gib)} GiB"
                    for e in ahead
                )
                + "."
            )
    for key, title in (
        ("host", "Lowest host peak per rank that passed correctness"),
        ("node", "Lowest node host peak that passed correctness"),
    ):
        if picks[key] is not None:
            lines.append(_pick_line(title, picks[key], gpu, ""))
    recommended = dict.fromkeys(pick.row.label for pick in picks.values() if pick)
    rows_by_label = {r.label: r for r in rows}
    lines += trim_lines(rows)
    return lines + [line for label in recommended for line in _floor_check(rows_by_label[label])]


def _pick_line(title: str, pick, gpu: bool, close: str) -> str:
    """One recommendation with its figures and, when several runs tie within 1%, how the tie was broken."""
    r, v = pick.row, pick.row.values()
    line = (
        f"{title}: `{r.strategy}` at tp={r.tp}{close}: {m.human(m.per_device_gib(r.result) * m.GIB)} per "
        f"{'GPU' if gpu else 'rank'}, host peak {_num(v['host_peak_gib'])} GiB per rank, node "
        f"{_num(v['node_host_peak_gib'])} GiB, {_num(v['tokens_per_s'], 1)} tokens/s; logits rel. err "
        f"{_num(v['logits_rel_err'], 4)}."
    )
    if len(pick.tied) > 1:
        line += (
            f" {len(pick.tied)} runs tie within 1%; the lowest host peak per rank wins: "
            + ", ".join(f"`{t.label}` {_num(t.values()['host_peak_gib'])} GiB" for t in pick.tied)
            + "."
        )
    return line


def _floor_check(row: Row) -> List[str]:
    """The recommended run's per-GPU peak against the memory model's floor for its configuration."""
    p, peak = row.prediction, m.headline(row.result, "gpu_peak_gib")
    if p is None or p.overhead is None or peak is None or not m.on_gpu(row.result):
        return []
    floor = p.floor() / m.GIB
    over = peak / floor - 1
    return [
        f"`{row.label}`: per-GPU peak {peak:.2f} GiB vs the memory model's floor {floor:.2f} GiB "
        f"({floor_terms(p)} measured outside PyTorch's allocator): {over:+.1%} over the floor, "
        f"{'within' if over <= FLOOR_MARGIN else 'beyond'} "
        f"{FLOOR_MARGIN:.0%}."
        + (
            " The floor counts the partition each GPU keeps; ZeRO-3 also gathers parameters "
            "onto the GPU for each layer it runs, a working set the memory model does not size."
            if p.strategy.zero_stage == 3 and over > FLOOR_MARGIN
            else ""
        )
    ]


def sections(
    rows: List[Row], extra: List[Extrapolated], figures: Dict[str, Path], memory: Optional[Dict[int, Path]] = None
) -> Dict[str, str]:
    """The report's sections by name (markdown, heading included); `python -m dsexp.report --print NAME` prints one."""
    gpu = any(m.on_gpu(r.result) for r in rows)
    weights = ["## Weights per rank: predicted vs measured", "", weights_table(rows), ""]
    off = [r for r in rows if r.values()["weights_err_pct"] is not None and abs(r.values()["weights_err_pct"]) > 2]
    if off:
        weights += ["Differences where the weights were not placed as predicted:", ""]
        weights += [
            f"- `{r.label}`: "
            + "; ".join(f.text for f in r.findings if f.code in ("nothing_sharded", "weights_differ"))
            for r in off
        ] + [""]
    diagnosis = ["## Diagnosis", ""]
    for r in rows:
        items = [f"- {'**problem**: ' if f.severity == 'problem' else ''}{f.text}." for f in r.findings]
        diagnosis += (
            [f"### `{r.label}`", ""] + (items or [f"- no diagnosis: {r.model_error or 'no measurements'}."]) + [""]
        )
    trims = trims_table(rows)
    parts = {
        "scripts": scripts_section(rows),
        "recommendation": ["## Recommendation", ""] + [f"- {line}" for line in recommendation(rows, extra)] + [""],
        "matrix": ["## Matrix", "", matrix_table(rows), ""],
        "stacks": stacks_section(rows),
        "weights": weights,
        "trims": (
            [
                "## Trims: each against the same configuration untrimmed",
                "",
                trims_table_note(any(m.on_gpu(r.result) for r in rows)),
                "",
                trims,
                "",
            ]
            if trims
            else []
        ),
        "predicted": ["## Predicted at tp values not run", "", extrapolation_table(extra, gpu, rows), ""],
        "diagnosis": diagnosis,
        "plots": ["## Plots", ""] + [f"![{k}]({PLOTS}/{p.name})" for k, p in figures.items()] + [""],
        "memory": memory_section(rows, memory or {}),
        "definitions": [
            "## Definitions",
            "",
            "- GiB = 2^30 bytes, MiB = 2^20 bytes. Per-GPU and per-rank figures are the maximum over ranks.",
            "- per-GPU peak: NVML device memory used at its peak (includes the CUDA context and communicators).",
            "- weights per GPU/rank: parameter + buffer bytes on the rank's compute device after init (census).",
            "- predicted: the memory model from the model's config alone (dsexp.analysis.memory); the floor adds "
            "the KV cache for prompt + generated tokens and the device memory the run measured outside PyTorch's "
            "allocator (max over phases of NVML process used - torch reserved, plus the device's own reserve at "
            "`start`: CUDA context, communicator, workspaces).",
            "- host peak / rank: RSS peak of one rank process; node host peak: total - available memory of the machine "
            "(left out, `-`, for jobs packed with other jobs: `launcher.pack=true`).",
            "- tp values not run: the memory model at that tp (weights: sharded part / tp + replicated; KV cache), "
            "anchored on the largest tp that completed: + its measured memory outside PyTorch and activations/cache "
            "(peak - floor); host per rank = its peak RSS - the modelled load cost at its tp + the cost at the new "
            "tp (checkpoint pages mapped at once + private bytes, by loading strategy); node = used before launch + "
            "ranks x private bytes per rank (page cache is reclaimable, not counted). Failed runs anchor nothing.",
            "",
        ],
    }
    return {name: "\n".join(lines) for name, lines in parts.items() if lines}


def memory_section(rows: List[Row], memory: Dict[int, Path]) -> List[str]:
    """Each run's memory against time, per rank, with its phases (failed runs too: up to where their ranks got)."""
    if not memory:
        return []
    out = ["## Memory over time", "", MEMORY_NOTE, "", TRACE_NOTE, ""]
    for i, path in memory.items():
        r = rows[i]
        out += [f"### `{r.label}` ({_status_word(r.result)})", "", f"![memory over time]({PLOTS}/{path.name})", ""]
    return out


MEMORY_NOTE = (
    "Per rank, what the background sampler read every 10 ms, kept where a value moved by more than 0.2% (1 MiB at "
    "least) or a second passed, with every phase's peak reading: host RSS and its private (anonymous) part, on a GPU "
    "NVML's device and process figures and torch's reserved and allocated; below, the node's used memory (every "
    "process on the machine). Shaded: the rank's phases (hatched: the one a rank died in)."
)


def _status_word(result: Dict[str, Any]) -> str:
    failure = result.get("failure") or {}
    return "ok" if result.get("status") == "ok" else f"failed: {failure.get('cause') or result.get('status')}"


def trims_table_note(gpu: bool) -> str:
    return (
        "Predicted: the memory model with the run's trims (dsexp.analysis.memory); measured: the census of each "
        "rank's device after init; saved: the untrimmed run's figure minus the trimmed one's, same tp"
        + (", per-GPU figures from NVML" if gpu else "")
        + ". A trim.env setting is recommended only where it saves memory and generate slows by less than 5%."
    )


def render_markdown(
    rows: List[Row],
    parts: Dict[str, str],
    source: str,
    parent: Optional[Dict[str, Any]] = None,
    view: Optional[str] = None,
) -> str:
    gpu = any(m.on_gpu(r.result) for r in rows)
    devices = sorted({str(r.values()["device"]) for r in rows})
    out = [
        "# dsexp sweep summary",
        "",
        f"Source: `{source}` · {len(rows)} runs · device: {', '.join(devices)} · "
        f"regenerate with `python -m dsexp.report {source}`",
        "",
    ]
    if parent:
        out += [
            f"MLflow: experiment `{parent['experiment']}`, sweep run `{parent['run_id']}` (this report is in its "
            f"artifacts under `report/`); side-by-side view of the runs: `{view}` in the MLflow UI "
            f"(`make ui`).",
            "",
        ]
    if not gpu:
        out += [
            "CPU runs: there is no GPU; per-device figures are the weights resident on each rank, whose "
            "device is the host. Host figures include each rank's Python runtime.",
            "",
        ]
    return "\n".join(out + list(parts.values()))


# --- plots ---------------------------------------------------------------------------------------


def write_plots(rows: List[Row], extra: List[Extrapolated], folder: Path) -> Dict[str, Path]:
    gpu = any(m.on_gpu(r.result) for r in rows)
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
        title = f"Memory over time: {r.label} ({_status_word(r.result)})"
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
