"""The sweep matrix: one row per configuration and tp, with prediction, measurement and diagnosis;
the recommendation; and the memory model's figures at tp values the sweep did not run."""
from __future__ import annotations

import traceback
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dsexp.analysis import measured as m
from dsexp.records import config_label
from dsexp.analysis.diagnosis import UNSHARDED, WEIGHT_TOL, Finding, diagnose, text
from dsexp.analysis.memory import TP_ENGINES, Prediction, predict

EXTRAPOLATE_TP = (4, 8)
TIE = 0.01  # configurations within 1% of the lowest figure count as tied; the lower host peak wins


@dataclass
class Row:
    result: Dict[str, Any]
    prediction: Optional[Prediction]
    findings: List[Finding] = field(default_factory=list)
    model_error: Optional[str] = None  # why no prediction could be made

    @property
    def config(self) -> Dict[str, Any]:
        return self.result.get("config") or {}

    @property
    def tp(self) -> int:
        return int(self.config.get("tp") or 1)

    @property
    def strategy(self) -> str:
        return config_label(self.config)

    @property
    def label(self) -> str:
        return f"{self.strategy} tp={self.tp}"

    def values(self) -> Dict[str, Any]:
        """The row as flat values (GiB, seconds); the CSV columns, in order."""
        r, p, corr = self.result, self.prediction, self.result.get("correctness") or {}
        w = m.weights_per_rank(r)
        pred_w = p.weights_max if p else None
        return {
            "config": self.strategy, "tp": self.tp, "status": _status(r),
            "correct": None if not corr else bool(corr.get("passed")), "logits_rel_err": corr.get("logits_rel_err"),
            "gpu_peak_gib": m.headline(r, "gpu_peak_gib"), "gpu_weights_gib": m.headline(r, "gpu_weights_gib"),
            "pred_weights_gib": _gib(pred_w),
            "weights_err_pct": 100 * (max(w) - pred_w) / pred_w if w and pred_w else None,
            "pred_floor_gib": _gib(p.floor()) if p and p.overhead is not None else None,
            "model_gib": _gib(p.model_bytes) if p else None,
            "host_peak_gib": m.headline(r, "host_peak_gib"), "host_anon_peak_gib": m.headline(r, "host_anon_peak_gib"),
            "node_host_peak_gib": m.headline(r, "node_host_peak_gib"),
            "load_s": m.headline(r, "load_s"), "init_s": m.headline(r, "init_s"),
            "generate_s": m.headline(r, "generate_s"), "tokens_per_s": m.headline(r, "tokens_per_s"),
            "device": (r.get("runtime") or {}).get("device") or self.config.get("device"),
            "diagnosis": text(self.findings) or (f"no memory model: {self.model_error}" if self.model_error else ""),
            "job": r.get("job_dir"), "run_id": (r.get("tracking") or {}).get("run_id"),
        }


def _status(r: Dict[str, Any]) -> str:
    if r.get("status") == "ok":
        return "ok"
    return f"{r.get('status', '?')}:{(r.get('failure') or {}).get('cause', '?')}"


def _gib(b: Optional[float]) -> Optional[float]:
    return None if b is None else b / m.GIB


def latest_per_config(results: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """One result per configuration key: an ok one if any, else the last."""
    by_key: Dict[str, Dict[str, Any]] = {}
    for r in results:
        key = r.get("key") or r.get("job_dir") or str(id(r))
        old = by_key.get(key)
        if old is None or r.get("status") == "ok" or old.get("status") != "ok":
            by_key[key] = r
    return list(by_key.values())


def build_rows(results: Sequence[Dict[str, Any]]) -> List[Row]:
    rows = []
    for r in latest_per_config(results):
        try:
            rows.append(Row(r, predict(r)))
        except Exception as e:  # a model we cannot rebuild still gets its measured row
            rows.append(Row(r, None, model_error=f"{type(e).__name__}: {e}"))
            traceback.print_exc()
    rows.sort(key=lambda row: (row.strategy, row.tp))
    for row in rows:
        siblings = [o.result for o in rows if o.strategy == row.strategy and o is not row]
        row.findings = diagnose(row.result, row.prediction, siblings)
    return rows


def _best(rows: List[Row], metric) -> Optional[Row]:
    ok = [r for r in rows if m.passed(r.result) and metric(r.result) is not None]
    if not ok:
        return None
    low = min(metric(r.result) for r in ok)
    tied = [r for r in ok if metric(r.result) <= low * (1 + TIE)]
    return min(tied, key=lambda r: (m.headline(r.result, "host_peak_gib") or float("inf"), metric(r.result)))


def recommend(rows: List[Row]) -> Tuple[Optional[Row], Optional[Row]]:
    """(lowest per-device figure, lowest host peak per rank) among runs that passed correctness."""
    return _best(rows, m.per_device_gib), _best(rows, lambda r: m.headline(r, "host_peak_gib"))


@dataclass
class Extrapolated:
    strategy: str
    tp: int
    measured: bool
    per_device_gib: Optional[float]     # GPU: calibrated peak; CPU: device-resident weights
    weights_gib: Optional[float]
    host_peak_gib: Optional[float]
    node_host_peak_gib: Optional[float]
    note: str = ""


def extrapolate(rows: List[Row], tps: Sequence[int] = EXTRAPOLATE_TP) -> List[Extrapolated]:
    """Per configuration: its measured tps, then the model's figures at `tps`, calibrated on the largest measured run.

    GPU peak = measured peak - predicted floor at the base tp + predicted floor at the new tp (the rest of
    the peak - activations, allocator cache - is carried over). Host per rank = measured peak - predicted
    load cost + predicted load cost at the new tp; node = measured + the private bytes of the added ranks.
    """
    out: List[Extrapolated] = []
    for strategy in dict.fromkeys(r.strategy for r in rows):
        mine = [r for r in rows if r.strategy == strategy]
        for r in mine:
            v = r.values()
            out.append(Extrapolated(strategy, r.tp, True, m.per_device_gib(r.result), v["gpu_weights_gib"],
                                    v["host_peak_gib"], v["node_host_peak_gib"], v["status"]))
        base = max((r for r in mine if m.weights_per_rank(r.result) and r.prediction), key=lambda r: r.tp,
                   default=None)
        for tp in tps:
            if any(r.tp == tp for r in mine):
                continue
            out.append(_at(base, strategy, tp) if base else
                       Extrapolated(strategy, tp, False, None, None, None, None, "no measured run to start from"))
    return out


def _at(base: Row, strategy: str, tp: int) -> Extrapolated:
    r, bp = base.result, base.prediction
    kv = bp.dims.kv_heads
    if bp.strategy.engine in TP_ENGINES and tp > kv:
        return Extrapolated(strategy, tp, False, None, None, None, None, f"not possible: the model has {kv} KV heads")
    p = predict(r, tp)
    if p.error:
        return Extrapolated(strategy, tp, False, None, None, None, None, f"engine refuses: {p.error[:80]}")
    scale, note = _as_measured(base)
    anchor = max(m.weights_per_rank(r) or [bp.weights_max])
    weights = anchor + scale * (p.weights_max - bp.weights_max)
    gpu = m.headline(r, "gpu_peak_gib")
    if m.on_gpu(r) and gpu is not None and p.overhead is not None:
        per_dev = gpu + (weights - anchor + scale * (max(p.kv_cache) - max(bp.kv_cache))) / m.GIB
    else:
        per_dev = weights / m.GIB
    host = m.headline(r, "host_peak_gib")
    host_pred = host + (_cost(p) - _cost(bp)) / m.GIB if host is not None else None
    node = m.headline(r, "node_host_peak_gib")
    per_rank_base = sum(m.start_anon(r)) / max(1, len(m.start_anon(r)))
    node_pred = (node + (p.host.node - bp.host.node + (tp - bp.tp) * per_rank_base) / m.GIB) if node is not None else None
    return Extrapolated(strategy, tp, False, per_dev, weights / m.GIB, host_pred, node_pred,
                        f"predicted from tp={bp.tp}{note}")


def _as_measured(base: Row) -> Tuple[float, str]:
    """How much of the modelled change with tp to trust: all of it when the base run placed its weights as
    predicted, none when it sharded nothing, else the measured/predicted ratio of the sharding."""
    meas, bp = max(m.weights_per_rank(base.result) or [0]), base.prediction
    if not meas or abs(meas - bp.weights_max) <= WEIGHT_TOL * bp.weights_max:
        return 1.0, ""
    if base.tp > 1 and meas >= UNSHARDED * bp.model_bytes:
        return 0.0, f" (nothing was sharded at tp={base.tp}: kept unsharded)"
    saved_pred, saved_meas = bp.model_bytes - bp.weights_max, bp.model_bytes - meas
    ratio = max(0.0, saved_meas / saved_pred) if saved_pred else 1.0
    return ratio, f" (scaled to the sharding measured at tp={base.tp}: {ratio:.2f} of the modelled saving)"


def _cost(p: Prediction) -> int:
    return max(f + a for f, a in zip(p.host.file, p.host.anon))
