"""The "stacks" section: the same configuration on each software stack of the sweep, side by side, and what differs
by more than 10% between them (no section with one stack)."""

from __future__ import annotations

from typing import Dict, List

from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Row
from dsexp.analysis.sections.common import ReportInputs, correct_cell, num, weights_unit
from dsexp.core.schema import stack_label

NAME = "stacks"
HEADER = [
    "configuration",
    "tp",
    "stack",
    "transformers / deepspeed",
    "status",
    "correct (rel. err)",
    "weights per rank ({unit})",
    "host anon / rank (GiB)",
    "node host peak (GiB)",
    "load (s)",
    "tokens/s",
]
RIGHT = [False, True, False, False, False, False, True, True, True, True, True]
DIFFERS = 1.1  # a figure that differs by more than 10% between stacks gets a line


def render(inputs: ReportInputs) -> str:
    return "\n".join(stacks_lines(inputs.rows))


def _stack(r: Row) -> str:
    return stack_label(r.config.get("stack") or {})


def stacks_lines(rows: List[Row]) -> List[str]:
    """The table and its notes (empty with one stack, or when no configuration ran on two)."""
    if len({_stack(r) for r in rows}) < 2:
        return []
    ws = weights_unit(rows)[1]
    by_config: Dict[tuple, List[Row]] = {}
    for r in rows:
        by_config.setdefault((r.strategy.split("@")[0], r.tp), []).append(r)
    body, notes = [], []
    for (config, tp), group in sorted(by_config.items()):
        if len(group) < 2:
            continue
        body += [_line(config, tp, r, ws) for r in sorted(group, key=_stack)]
        notes += _stack_differences(config, tp, group)
    if not body:
        return []
    header = [h.format(unit=weights_unit(rows)[0]) for h in HEADER]
    return ["## Software stacks", "", md_table(header, body, RIGHT), ""] + [f"- {n}" for n in notes] + [""]


def _line(config: str, tp: int, r: Row, ws: float) -> list:
    v, versions = r.values(), r.record.versions
    return [
        config,
        tp,
        _stack(r),
        f"{versions.get('transformers', '-')} / {versions.get('deepspeed', '-')}",
        v["status"],
        correct_cell(v),
        num(v["gpu_weights_gib"], 2, ws),
        num(v["host_anon_peak_gib"]),
        num(v["node_host_peak_gib"]),
        num(v["load_s"]),
        num(v["tokens_per_s"], 1),
    ]


def _stack_differences(config: str, tp: int, group: List[Row]) -> List[str]:
    """One line per figure that differs by more than 10% between the stacks of one configuration."""
    out = []
    for key, what in (
        ("host_anon_peak_gib", "private host memory per rank"),
        ("gpu_weights_gib", "weights per rank"),
        ("node_host_peak_gib", "node host peak"),
    ):
        vals = {_stack(r): r.values()[key] for r in group if r.values()[key]}
        if len(vals) > 1 and max(vals.values()) > DIFFERS * min(vals.values()):
            out.append(f"`{config}` at tp={tp}: {what} " + ", ".join(f"{v:.2f} GiB on {s}" for s, v in vals.items()))
    statuses = {_stack(r): r.values()["status"] for r in group}
    if len(set(statuses.values())) > 1:
        out.append(f"`{config}` at tp={tp}: " + ", ".join(f"{st} on {s}" for s, st in statuses.items()))
    return out
