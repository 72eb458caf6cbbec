"""The "latency" section: each workload point's time to first token, time per output token, end to end and tokens/s
(dsexp.rank.generation measures them as optimum-benchmark does; Definitions says what each is)."""

from __future__ import annotations

from dsexp.analysis import workload_points as capa
from dsexp.analysis.sections.common import ReportInputs, num

NAME = "latency"


def render(inputs: ReportInputs) -> str:
    points = [q for q in capa.point_rows(inputs.rows) if q.status == "ok" and q.latency]
    if not points:
        return ""
    shared = any(r.record.shared_gpu for r in inputs.rows)
    lines = ["## Latency against batch", ""]
    if shared:
        lines += ["Runs whose ranks shared one GPU talk over gloo: their times are not a multi-GPU machine's.", ""]
    lines += [
        "| configuration | tp | batch | prompt | TTFT p50 / p90 / p99 (ms) | TPOT p50 / p90 / p99 (ms) | "
        "e2e p50 (s) | tokens/s | timed calls |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for q in points:
        lat = q.latency
        lines.append(
            f"| `{q.config}` | {q.tp} | {q.batch} | {q.prompt_tokens} | {percentiles(lat.get('ttft'))} | "
            f"{tpot_cell(lat)} | {num((lat.get('e2e') or {}).get('p50'), 3)} | "
            f"{num(lat.get('tokens_per_s'), 1)} | {(lat.get('e2e') or {}).get('n', '-')} |"
        )
    if any(tpot_cell(q.latency) == TPOT_UNKNOWN for q in points):
        lines += ["", f'TPOT shown as "{TPOT_UNKNOWN}": {TPOT_UNKNOWN_WHY}']
    return "\n".join(lines + [""])


TPOT_UNKNOWN = "- (older record)"
TPOT_UNKNOWN_WHY = (
    "a record made before TTFT was stamped inside each timed call took its TTFT from other calls than its e2e; "
    "where that TTFT exceeded the e2e, no TPOT can be told from it."
)


def tpot_cell(lat) -> str:
    """TPOT's percentiles; an older record's negative TPOT (its TTFT from other calls than its e2e) is not one."""
    return TPOT_UNKNOWN if capa.older_negative_tpot(lat) else percentiles(lat.get("tpot"))


def percentiles(s) -> str:
    s = s or {}
    return " / ".join(num(s.get(q), 1, 1000.0) for q in ("p50", "p90", "p99"))
