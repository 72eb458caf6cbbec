"""The "quant" section: each quantized run (quant=, dsexp.quant) beside the quality it costs and what it held: the
weights per rank at their width, measured against the memory model, the peak of the phase that quantized them, the
time it took, the first-step logits' relative error and the greedy tokens' agreement against the tp=1 run without
quantization, and the speed; a run that failed, with the library's own error (the composition matrix)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.analysis import measured as m
from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Row
from dsexp.analysis.sections.common import ReportInputs, num, ranks_cell, weights_unit
from dsexp.core.result import Phase

NAME = "quant"
NOTE = (
    "Quality is measured against the same model at tp=1 without quantization, same dtype: the first step's logits "
    "(relative L2 error) and the share of the greedy tokens that agree. On random weights (dsexp's generated "
    "checkpoints) that is numerical agreement, not task accuracy: near-ties between random logits flip tokens that a "
    "trained model would keep. With a real checkpoint (model=local) it is that model's own."
)


def quant_of(row: Row) -> Dict[str, Any]:
    return dict(row.config.get("quant") or {})


def quantized(row: Row) -> bool:
    q = quant_of(row)
    return (q.get("name") or "none") != "none" or q.get("kv") is not None


def render(inputs: ReportInputs) -> str:
    rows = [r for r in inputs.rows if quantized(r)]
    if not rows:
        return ""
    wu, ws = weights_unit(inputs.rows)
    header = ["configuration", "tp", "status", f"weights per rank ({wu})", f"predicted ({wu})", "quantize (s)",
              "logits rel. err", "tokens agree", "passed", "tokens/s"]  # fmt: skip
    body = [_line(r, ws) for r in rows]
    table = md_table(header, body, [False, True, False, True, True, True, True, True, False, True])
    return "\n".join(["## Quantization: memory, quality, speed", "", table, "", NOTE, ""])


def _line(r: Row, ws: float) -> List[Any]:
    v = r.values()
    corr = r.record.correctness or {}
    weights = m.weights_per_rank(r.record)
    predicted = r.prediction.weights if r.prediction is not None else []
    status = v["status"] if r.record.ok else f"failed: {_error(r)}"
    return [
        r.strategy,
        r.tp,
        status,
        ranks_cell(weights, ws),
        ranks_cell(predicted, ws),
        num(_quantize_seconds(r), 2),
        "-" if corr.get("logits_rel_err") is None else f"{corr['logits_rel_err']:.3g}",
        "-" if corr.get("token_agreement") is None else f"{corr['token_agreement']:.2f}",
        "-" if not corr else ("yes" if corr.get("passed") else f"**no** (> {corr.get('tolerance')})"),
        num(v["tokens_per_s"], 1),
    ]


def _quantize_seconds(r: Row) -> Optional[float]:
    """The quantize phase's wall time, busiest rank (torchao's members; those quantized at load report none)."""
    secs = [rk.phase(Phase.QUANTIZE).wall_s for rk in r.record.ranks if rk.phase(Phase.QUANTIZE).recorded]
    return max(secs) if secs else None


def _error(r: Row) -> str:
    text = str((r.result.get("failure") or {}).get("message") or r.record.cause or "")
    return text[:160].replace("|", "/")
