"""The "trims" section: each trimmed run against the same configuration untrimmed at the same tp (weights predicted
and measured, what it saved, correctness, speed, a verdict); `trim_lines` is the recommendation's view of them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from dsexp.analysis import measured as m
from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Row, main_model, untrimmed_label
from dsexp.analysis.sections.common import ReportInputs, correct_cell, num, on_gpu, ranks_cell, weights_unit
from dsexp.trims import active as trims_active

NAME = "trims"
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
        if not m.passed(self.row.record):
            return "**not correct**" if self.row.record.ok else "failed"
        if self.base is None or self.per_device is None:
            return "correct; no untrimmed run to compare"
        saves = self.per_device > 0 or (self.outside or 0) > 0
        if self.env_only and self.speed is not None and self.speed < 1 - SLOWER:
            return f"not recommended: generate {1 - self.speed:.0%} slower"
        if not self.env_only:
            return "correct, saves memory" if saves else "correct, no saving"
        return "recommended" if saves else "no saving"


def render(inputs: ReportInputs) -> str:
    table = trims_table(inputs.rows)
    if not table:
        return ""
    title = "## Trims: each against the same configuration untrimmed"
    return "\n".join([title, "", trims_table_note(inputs.gpu), "", table, ""])


def trim_effects(rows: List[Row]) -> List[TrimEffect]:
    by_label = {(r.strategy, r.tp): r for r in rows}
    out = []
    for r in rows:
        if r.values()["trims"]:
            out.append(_effect(r, by_label.get((untrimmed_label(r.config), r.tp))))
    return out


def _effect(r: Row, base: Optional[Row]) -> TrimEffect:
    if base is None or not m.completed(base.record) or not m.completed(r.record):
        return TrimEffect(r, base, None, None, None, None)
    a, b = m.weights_per_rank(base.record), m.weights_per_rank(r.record)
    pa, pb = m.per_device_gib(base.record), m.per_device_gib(r.record)
    oa, ob = (m.outside_parts(x.record) for x in (base, r))
    ta, tb = m.headline(base.record, "tokens_per_s"), m.headline(r.record, "tokens_per_s")
    return TrimEffect(
        r,
        base,
        max(a) - max(b) if a and b else None,
        pa - pb if pa is not None and pb is not None else None,
        (oa["outside"] - ob["outside"]) / m.GIB if oa and ob else None,
        tb / ta if ta and tb else None,
    )


def trims_table(rows: List[Row]) -> Optional[str]:
    effects = trim_effects(rows)
    if not effects:
        return None
    wu, ws = weights_unit(rows)
    gpu = on_gpu(rows)
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
    body = [_line(e, ws, gpu) for e in effects]
    return md_table(header, body, [False, True, False] + [True] * (len(header) - 6) + [False, True, False])


def _line(e: TrimEffect, ws: float, gpu: bool) -> list:
    r, v, p = e.row, e.row.values(), e.row.prediction
    meas = m.weights_per_rank(r.record)
    exact = "-" if not (p and meas) else "exact" if list(meas) == list(p.weights) else f"{v['weights_err_pct']:+.1f}%"
    exact = exact.replace("+0.0%", "<0.05%")
    return (
        [
            untrimmed_label(r.config),
            r.tp,
            v["trims"],
            ranks_cell(p.weights, ws) if p else "-",
            ranks_cell(meas, ws),
            exact,
            num(None if e.weights is None else e.weights / m.GIB, 2, ws),
        ]
        + ([num(e.per_device), num(e.outside)] if gpu else [])
        + [
            correct_cell(v),
            num(v["tokens_per_s"], 1) + ("" if e.speed is None else f" ({e.speed:.2f}x)"),
            e.verdict(),
        ]
    )


def trims_table_note(gpu: bool) -> str:
    return (
        "Predicted: the memory model with the run's trims (dsexp.analysis.memory); measured: the census of each "
        "rank's device after init; saved: the untrimmed run's figure minus the trimmed one's, same tp"
        + (", per-GPU figures from NVML" if gpu else "")
        + ". A trim.env setting is recommended only where it saves memory and generate slows by less than 5%."
    )


def trim_lines(rows: List[Row]) -> List[str]:
    """The recommendation's view of the trims: what the best trimmed run saves over the same one untrimmed, and
    which trim.env settings cut memory at generate slowed by less than 5%."""
    model = main_model(rows)
    effects = [e for e in trim_effects(rows) if (e.row.config.get("model") or {}).get("name") == model]
    if not effects:
        return []
    unit = "per GPU" if on_gpu(rows) else "per rank"
    return _best_model_trim(effects, unit) + _env_settings(effects, unit)


def _best_model_trim(effects: List[TrimEffect], unit: str) -> List[str]:
    """The trimmed configuration (not trim.env alone) that saves the most, against its untrimmed run."""
    model_trims = [e for e in effects if not e.env_only and e.per_device is not None and m.passed(e.row.record)]
    if not model_trims:
        return []
    best = max(model_trims, key=lambda e: (e.per_device, e.row.tp))
    return [
        f"Trimmed configurations are compared with the rest: `{best.row.label}` saves "
        f"{m.human(best.per_device * m.GIB)} {unit} over `{best.base.label}` "
        f"({m.human(m.per_device_gib(best.base.record) * m.GIB)} -> "
        f"{m.human(m.per_device_gib(best.row.record) * m.GIB)}), "
        f"tokens/s {num(best.base.values()['tokens_per_s'], 1)} -> {num(best.row.values()['tokens_per_s'], 1)}."
    ]


def _env_settings(effects: List[TrimEffect], unit: str) -> List[str]:
    """trim.env settings, recommended (memory cut, generate slowed by less than 5%) or not."""
    env = [e for e in effects if e.env_only and e.base is not None]
    good = [e for e in env if e.verdict() == "recommended"]
    bad = [e for e in env if e.verdict() != "recommended"]
    lines = []
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
        f"{num(e.per_device)} GiB {unit} saved, {num(e.outside)} GiB of it outside the allocator{speed}"
        if e.per_device is not None
        else "no comparison"
    )
