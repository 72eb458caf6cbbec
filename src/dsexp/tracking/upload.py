"""The sweep report in MLflow: its files as artifacts of the sweep's parent run, the recommendation as tags on
it, each child run's prediction and diagnosis, and a shared view of the runs in the MLflow UI."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from dsexp.analysis import measured as m
from dsexp.analysis.matrix import OUTSIDE_COLUMNS, Row, recommend
from dsexp.analysis.summary import PLOTS, SUMMARY_CSV, SUMMARY_MD, memory_plot, write_report
from dsexp.tracking.runs import Tracker, retry

CHILD_MEMORY_PLOT = "memory_over_time.png"  # each job run's own copy of its plot from the report
CHILD_METRICS = {
    "pred.weights_gib": "pred_weights_gib",
    "pred.weights_err_pct": "weights_err_pct",
    "pred.floor_gib": "pred_floor_gib",
    "pred.model_gib": "model_gib",
    **{f"outside.{k}_gib": f"outside_{k}_gib" for k in OUTSIDE_COLUMNS},  # GPU: memory outside the allocator
}
HEADLINE_COLUMNS = (
    "gpu_peak_gib",
    "gpu_weights_gib",
    "pred.weights_gib",
    "pred.weights_err_pct",
    "host_peak_gib",
    "host_anon_peak_gib",
    "node_host_peak_gib",
    "correct",
    "logits_rel_err",
    "load_s",
    "init_s",
    "generate_s",
    "tokens_per_s",
)
PARAM_COLUMNS = ("model.name", "load.name", "engine.name", "engine.kernel_inject", "zero.name", "dtype", "tp")


def _tracker(parent: Optional[Dict[str, Any]]):
    if not parent:
        return None
    uri = parent.get("uri") or ""
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///") :]).is_file():
        print(
            f"dsexp report: the sweep's MLflow store {uri} is not on this machine; report written to disk only",
            file=sys.stderr,
        )
        return None
    try:
        return Tracker(parent["uri"], parent["experiment"])
    except Exception as e:
        print(f"dsexp report: MLflow store {parent.get('uri')} unavailable: {e}", file=sys.stderr)
        return None


def mlflow_view(tracker, parent: Dict[str, Any], rows: List[Row]) -> Optional[str]:
    """A shared view of the sweep's job runs in the MLflow UI: the settings that vary and the headline metrics as
    columns, sorted by the per-device figure. Stored the way the UI's own "Share" stores views (an experiment tag
    `mlflow.sharedViewState.<key>` holding the view's JSON); returns the UI route that opens it."""
    gpu = any(m.on_gpu(r.result) for r in rows)
    key = f"dsexp-{parent['run_id']}"
    state = {
        "searchFilter": f"tags.mlflow.parentRunId = '{parent['run_id']}'",
        "orderByKey": "metrics.`" + ("gpu_peak_gib" if gpu else "gpu_weights_gib") + "`",
        "orderByAsc": True,
        "selectedColumns": [f"params.`{p}`" for p in PARAM_COLUMNS]
        + [f"metrics.`{k}`" for k in HEADLINE_COLUMNS if gpu or k != "gpu_peak_gib"]
        + ["tags.`dsexp.diagnosis`"],
    }
    try:
        retry(
            lambda: tracker.client.set_experiment_tag(
                tracker.experiment_id, f"mlflow.sharedViewState.{key}", json.dumps(state)
            )
        )
    except Exception as e:
        print(f"dsexp report: could not save the MLflow view: {e}", file=sys.stderr)
        return None
    # workflowType: MLflow 3's UI otherwise opens its GenAI pages, which have no runs table
    return f"#/experiments/{tracker.experiment_id}/runs?viewStateShareKey={key}&workflowType=machine_learning"


def log_to_mlflow(tracker, parent: Dict[str, Any], out: Path, rows: List[Row]) -> None:
    """Report files as artifacts of the parent run (report/), the recommendation on it; prediction, diagnosis and
    the memory-over-time plot on each child run logged in the same store."""
    client, rid = tracker.client, parent["run_id"]
    for name in (SUMMARY_MD, SUMMARY_CSV):
        retry(lambda: client.log_artifact(rid, str(out / name), "report"))
    tracker.log_artifact_dir(rid, out / PLOTS, "report/plots")
    picks = recommend(rows)
    best = picks["per_device"].row if picks["per_device"] else None
    tags = {"dsexp.recommendation": best.label if best else "none passed correctness"}
    for key, tag in (("per_device_no_offload", "no_offload"), ("host", "host"), ("node", "node")):
        if picks[key]:
            tags[f"dsexp.recommendation_{tag}"] = picks[key].row.label
    for k, v in tags.items():
        retry(lambda: client.set_tag(rid, k, v))
    if best:
        tracker.log_metrics(
            rid,
            {
                "best_per_device_gib": m.per_device_gib(best.result) or float("nan"),
                "best_host_peak_gib": m.headline(best.result, "host_peak_gib") or float("nan"),
            },
        )
    for i, r in enumerate(rows):
        tracking = r.result.get("tracking") or {}
        child = tracking.get("run_id")
        if not child or tracking.get("uri") not in (None, parent["uri"]):
            continue
        v = r.values()
        tracker.log_metrics(child, {name: v[k] for name, k in CHILD_METRICS.items() if v[k] is not None})
        retry(lambda: client.set_tag(child, "dsexp.diagnosis", v["diagnosis"][:4900] or "-"))
        plot = out / PLOTS / memory_plot(i)
        if plot.is_file():
            tracker.log_artifact_as(child, plot, CHILD_MEMORY_PLOT)


class ParentRun:
    """The `mlflow` argument of `write_report`: the sweep's parent run in a store this process can reach."""

    def __init__(self, tracker: Tracker, parent: Dict[str, Any]):
        self.tracker, self.parent = tracker, parent

    def view(self, rows: List[Row]) -> Tuple[Dict[str, Any], Optional[str]]:
        return self.parent, mlflow_view(self.tracker, self.parent, rows)

    def attach(self, out: Path, rows: List[Row]) -> None:
        try:
            log_to_mlflow(self.tracker, self.parent, out, rows)
        except Exception as e:  # the files on disk are the report; MLflow is a copy
            print(
                f"dsexp report: could not attach the report to MLflow run {self.parent.get('run_id')}: {e}",
                file=sys.stderr,
            )


def report_sweep(
    sweep_dir: Path,
    parent: Optional[Dict[str, Any]] = None,
    results: Optional[Sequence[Dict[str, Any]]] = None,
    out_dir: Optional[Path] = None,
    source: Optional[str] = None,
) -> Optional[Dict[str, str]]:
    """write_report, attached to the sweep's parent run when its store is reachable."""
    tracker = _tracker(parent)
    return write_report(sweep_dir, results, out_dir, source, ParentRun(tracker, parent) if tracker else None)
