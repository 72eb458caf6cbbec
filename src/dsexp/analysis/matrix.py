"""The sweep matrix: one row per configuration and tp, with prediction, measurement and diagnosis;
the recommendation; and the memory model's figures at tp values the sweep did not run."""

from __future__ import annotations

import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from dsexp.analysis import measured as m
from dsexp.analysis.diagnosis import UNSHARDED, WEIGHT_TOL, Finding, diagnose, text
from dsexp.analysis.labels import config_label
from dsexp.analysis.memory import predict, splits_weights
from dsexp.core.result import JobRecord
from dsexp.predict.weights_per_rank import Prediction
from dsexp.trims import label as trims_label

EXTRAPOLATE_TP = (4, 8)
TIE = 0.01  # configurations within 1% of the lowest figure count as tied; the lower host peak wins


@dataclass
class Row:
    result: Dict[str, Any]
    prediction: Optional[Prediction]
    findings: List[Finding] = field(default_factory=list)
    model_error: Optional[str] = None  # why no prediction could be made

    @property
    def record(self) -> JobRecord:
        """The run's result as a typed record (what sections read)."""
        return JobRecord.of(self.result)

    @property
    def config(self) -> Mapping[str, Any]:
        return self.record.config

    @property
    def tp(self) -> int:
        return self.record.tp

    @property
    def strategy(self) -> str:
        return config_label(self.config)

    @property
    def label(self) -> str:
        return f"{self.strategy} tp={self.tp}"

    def values(self) -> Dict[str, Any]:
        """The row as flat values (GiB, seconds); the CSV columns, in order."""
        r, p = self.record, self.prediction
        corr, w = r.correctness, m.weights_per_rank(r)
        pred_w = p.weights_max if p else None
        return {
            "config": self.strategy,
            "tp": self.tp,
            "status": status(r),
            "correct": None if not corr else bool(corr.get("passed")),
            "logits_rel_err": corr.get("logits_rel_err"),
            "gpu_peak_gib": m.headline(r, "gpu_peak_gib"),
            "gpu_weights_gib": m.headline(r, "gpu_weights_gib"),
            "pred_weights_gib": _gib(pred_w),
            "weights_err_pct": 100 * (max(w) - pred_w) / pred_w if w and pred_w and r.completed else None,
            "pred_floor_gib": _gib(p.floor()) if p and p.overhead is not None else None,
            "model_gib": _gib(p.model_bytes) if p else None,
            "host_peak_gib": m.headline(r, "host_peak_gib"),
            "host_anon_peak_gib": m.headline(r, "host_anon_peak_gib"),
            "node_host_peak_gib": m.headline(r, "node_host_peak_gib"),
            "load_s": m.headline(r, "load_s"),
            "init_s": m.headline(r, "init_s"),
            "generate_s": m.headline(r, "generate_s"),
            "tokens_per_s": m.headline(r, "tokens_per_s"),
            "trims": trims_label(self.config.get("trim")) or "",
            **{f"outside_{k}_gib": _gib(v) for k, v in _outside_columns(r).items()},
            "device": r.runtime.get("device") or self.config.get("device"),
            "diagnosis": text(self.findings) or (f"no memory model: {self.model_error}" if self.model_error else ""),
            "job": r.raw.get("job_dir"),
            "run_id": (r.raw.get("tracking") or {}).get("run_id"),
        }


OUTSIDE_COLUMNS = (*m.OUTSIDE_PARTS, "unexplained")


def _outside_columns(r: JobRecord) -> Dict[str, Optional[int]]:
    parts = m.outside_parts(r) or {}
    return {k: parts.get(k) for k in OUTSIDE_COLUMNS}


def untrimmed_label(config: Dict[str, Any]) -> str:
    """The label of the same configuration without its trims (its sibling in a sweep)."""
    return config_label({k: v for k, v in config.items() if k != "trim"})


def status(r: JobRecord) -> str:
    """A job's status as the matrix says it: ok, failed:<cause>, or, for a job that ran to its end while every
    workload point ran out of memory (a budget search's upper bracket), oom: nothing it measured fits."""
    if not r.ok:
        return f"{r.status or '?'}:{r.cause or '?'}"
    rank0 = next(iter(r.ranks), None)
    points = (rank0.points if rank0 is not None else None) or []
    if points and not any(p.get("status") == "ok" for p in points):
        return "oom: every point"
    return "ok"


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
        except LookupError as e:  # nothing to rebuild (a script that failed before loading a model): said in words
            rows.append(Row(r, None, model_error=str(e).strip("'\"")))
        except Exception as e:  # a model we cannot rebuild still gets its measured row, and the console one line
            rows.append(Row(r, None, model_error="the memory model could not rebuild this model"))
            print(f"dsexp: no prediction for {r.get('job_dir') or r.get('key')}: {type(e).__name__}: {e}"[:500],
                  file=sys.stderr)  # fmt: skip
    rows.sort(key=lambda row: (row.strategy, row.tp))
    for row in rows:
        siblings = [o.result for o in rows if o.strategy == row.strategy and o is not row]
        row.findings = diagnose(row.result, row.prediction, siblings)
    return rows


@dataclass
class Pick:
    """The recommended row for one criterion and the rows tied with it (within TIE of the lowest figure)."""

    row: Row
    tied: List[Row]


def _best(rows: List[Row], metric, keep=lambda r: True) -> Optional[Pick]:
    """The lowest figure among runs that passed correctness; ties within 1% go to the lower host peak per rank."""
    ok = [r for r in rows if m.passed(r.result) and keep(r) and metric(r.result) is not None]
    if not ok:
        return None
    low = min(metric(r.result) for r in ok)
    tied = [r for r in ok if metric(r.result) <= low * (1 + TIE)]
    tied.sort(key=lambda r: (m.headline(r.result, "host_peak_gib") or float("inf"), metric(r.result)))
    return Pick(tied[0], tied)


def offloads(row: Row) -> bool:
    return (
        any(pl.how == "offloaded" for pl in row.prediction.placements)
        if row.prediction
        else (row.config.get("zero") or {}).get("offload", "none") != "none"
    )


RECOMMENDATIONS = ("per_device", "per_device_no_offload", "host", "node")


def main_model(rows: List[Row]) -> Optional[str]:
    """The model most runs of the sweep used: recommendations compare runs of one model only."""
    names = Counter((r.config.get("model") or {}).get("name") for r in rows)
    return names.most_common(1)[0][0] if names else None


def recommend(rows: List[Row]) -> Dict[str, Optional[Pick]]:
    """Among runs of the main model that passed correctness: the lowest per-device figure, the same without
    offload, the lowest host peak per rank and the lowest node host peak (keys: RECOMMENDATIONS)."""
    model = main_model(rows)
    rows = [r for r in rows if (r.config.get("model") or {}).get("name") == model]
    return {
        "per_device": _best(rows, m.per_device_gib),
        "per_device_no_offload": _best(rows, m.per_device_gib, keep=lambda r: not offloads(r)),
        "host": _best(rows, lambda r: m.headline(r, "host_peak_gib")),
        "node": _best(rows, lambda r: m.headline(r, "node_host_peak_gib")),
    }


@dataclass
class Extrapolated:
    strategy: str
    tp: int
    measured: bool
    per_device_gib: Optional[float]  # GPU: calibrated peak; CPU: device-resident weights
    weights_gib: Optional[float]
    host_peak_gib: Optional[float]
    node_host_peak_gib: Optional[float]
    note: str = ""


def extrapolate(rows: List[Row], tps: Sequence[int] = EXTRAPOLATE_TP) -> List[Extrapolated]:
    """Per configuration: its measured tps, then the model's figures at `tps`, anchored on the largest measured
    run that completed (see `_at`)."""
    out: List[Extrapolated] = []
    for strategy in dict.fromkeys(r.strategy for r in rows):
        mine = [r for r in rows if r.strategy == strategy]
        for r in mine:
            v = r.values()
            out.append(
                Extrapolated(
                    strategy,
                    r.tp,
                    True,
                    m.per_device_gib(r.result),
                    v["gpu_weights_gib"],
                    v["host_peak_gib"],
                    v["node_host_peak_gib"],
                    v["status"],
                )
            )
        base = max(
            (r for r in mine if m.completed(r.result) and m.weights_per_rank(r.result) and r.prediction),
            key=lambda r: r.tp,
            default=None,
        )
        for tp in tps:
            if any(r.tp == tp for r in mine):
                continue
            out.append(
                _at(base, strategy, tp)
                if base
                else Extrapolated(strategy, tp, False, None, None, None, None, "no completed run to start from")
            )
    return out


def _at(base: Row, strategy: str, tp: int) -> Extrapolated:
    """The memory model at `tp`, anchored on what the base run measured; nothing is extrapolated linearly.

    weights: the model's (sharded part / tp + replicated), see `_weights_at`. GPU peak: weights + the allocator's
    segments beyond them + KV cache at `tp` + the base run's measured memory outside PyTorch + its measured
    activations and allocator cache (peak - floor), or the measured peak itself when the whole model passed through
    the GPU at init (that does not shrink with tp). Host per rank: the base run's peak RSS - the modelled load cost
    at its tp + the modelled cost at `tp` (mapped checkpoint pages + private bytes, per loading strategy). Node:
    used before launch + ranks x the private bytes per rank (measured at the base tp, + the modelled change); the
    checkpoint's page cache is reclaimable and not counted."""
    r, bp = base.result, base.prediction
    kv = bp.dims.kv_heads
    if splits_weights(bp.strategy.engine) and tp > kv:
        return Extrapolated(strategy, tp, False, None, None, None, None, f"not possible: the model has {kv} KV heads")
    p = predict(r, tp)
    if p.error:
        return Extrapolated(strategy, tp, False, None, None, None, None, f"engine refuses: {p.error[:80]}")
    weights, note = _weights_at(base, p)
    per_dev, gpu = weights, m.headline(r, "gpu_peak_gib")
    if m.on_gpu(r) and gpu is not None and p.overhead is not None:
        extra = max(0, gpu * m.GIB - bp.floor())
        per_dev = weights + (p.floor() - p.weights_max) + extra  # + allocator segments, KV cache, outside memory
        if any(f.code == "init_transient" for f in base.findings):
            per_dev, note = (
                max(per_dev, gpu * m.GIB),
                note + "; peak kept: the whole model passes through the GPU at init",
            )
        else:
            note += f"; + measured {extra / m.GIB:.2f} GiB activations/cache"
    host = m.headline(r, "host_peak_gib")
    start_rss = max(m.start_host(r, "rss"), default=0)
    host_pred = max(start_rss, host * m.GIB - _cost(bp) + _cost(p)) / m.GIB if host is not None else None
    growth = m.node_growth(r)
    node_pred = None
    if growth is not None:
        private = max(0, growth / bp.tp + max(p.host.anon) - max(bp.host.anon))
        node_pred = ((r.get("baseline") or {})["node_used"] + tp * private) / m.GIB
    return Extrapolated(
        strategy,
        tp,
        False,
        per_dev / m.GIB,
        weights / m.GIB,
        host_pred,
        node_pred,
        f"model at tp={tp} anchored on tp={bp.tp}: {note}",
    )


def _weights_at(base: Row, p: Prediction) -> Tuple[float, str]:
    """Weights per device at p.tp: the model's when the base run placed its weights as predicted; unsharded when
    it sharded nothing; else the model scaled by the base run's measured/predicted ratio, never below the bytes
    no tp splits."""
    meas, bp = max(m.weights_per_rank(base.result)), base.prediction
    if abs(meas - bp.weights_max) <= WEIGHT_TOL * bp.weights_max:
        return p.weights_max, "weights as modelled"
    if base.tp > 1 and meas >= UNSHARDED * bp.model_bytes:
        return meas, f"nothing was sharded at tp={base.tp}: kept unsharded"
    ratio = meas / bp.weights_max
    return max(p.unshardable, p.weights_max * ratio), (
        f"weights modelled x {ratio:.2f} (measured/predicted at "
        f"tp={base.tp}), not below the {m.human(p.unshardable)} no tp splits"
    )


def _cost(p: Prediction) -> int:
    return max(f + a for f, a in zip(p.host.file, p.host.anon))
