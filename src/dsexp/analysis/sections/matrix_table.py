"""The "matrix" section: one line per configuration and tp, measured against predicted, with speed and (GPU) where
the memory outside PyTorch's allocator went."""

from __future__ import annotations

from typing import Any, Dict, List

from dsexp.analysis import measured as m
from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Row
from dsexp.analysis.sections.common import ReportInputs, correct_cell, num, on_gpu, weights_unit

NAME = "matrix"
SHARED_GPU_NOTE = (
    "Times in parentheses: the ranks shared one GPU over gloo (launcher.gpus): their memory per rank is real, their "
    "times are not a multi-GPU machine's and are left out of every speed comparison. NCCL's own buffers: not "
    "measured (shared GPU)."
)
OUTSIDE_HEADER = "context + comm + load/init + generate + device (+ unexplained)"


def render(inputs: ReportInputs) -> str:
    return "\n".join(["## Matrix", "", matrix_table(inputs.rows), ""])


def matrix_table(rows: List[Row]) -> str:
    wu, ws = weights_unit(rows)
    gpu = on_gpu(rows)
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
            [v["config"], v["tp"], v["status"], correct_cell(v)]
            + ([num(v["gpu_peak_gib"])] if gpu else [])
            + [
                num(v["gpu_weights_gib"], 2, ws),
                num(v["pred_weights_gib"], 2, ws),
                "-" if v["weights_err_pct"] is None else f"{v['weights_err_pct']:+.1f}%",
                num(v["host_peak_gib"]),
                num(v["host_anon_peak_gib"]),
                num(v["node_host_peak_gib"]),
            ]
            + _speed_cells(r)
            + ([_outside_cell(v)] if gpu else [])
        )
    table = md_table(header, body, [False, True, False, False] + [True] * (len(header) - 4))
    if any(not m.speed_representative(r.record) for r in rows):
        table += f"\n\n{SHARED_GPU_NOTE}"
    return table


def _speed_cells(r: Row) -> List[str]:
    """load, init, generate seconds and tokens/s; in parentheses for a run whose ranks shared a GPU."""
    cells = [num(m.raw_headline(r.record, k), 1 if k == "tokens_per_s" else 2) for k in m.SPEED]
    return cells if m.speed_representative(r.record) else [f"({c})" if c != "-" else c for c in cells]


def _outside_cell(v: Dict[str, Any]) -> str:
    parts = [v[f"outside_{k}_gib"] for k in m.OUTSIDE_PARTS]
    if all(p is None for p in parts):
        return "-"
    left = v["outside_unexplained_gib"]
    return " + ".join(num(p) for p in parts) + ("" if left is None else f" ({left:+.2f})")
