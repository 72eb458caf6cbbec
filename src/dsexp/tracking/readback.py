"""A report's runs from MLflow: the job runs of an experiment or of one sweep parent run (each job run carries its
job folder, result.json included, as artifacts; without it the result is rebuilt from the run's params and
metrics, which is enough for the matrix)."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsexp.core.fs import read_json
from dsexp.core.records import HEADLINE
from dsexp.tracking.runs import retry


def results_from_mlflow(
    uri: str, experiment: Optional[str] = None, parent_run: Optional[str] = None
) -> Tuple[List[Dict[str, Any]], Optional[Dict[str, Any]]]:
    """Job results of an experiment or of one sweep parent run, and the parent state to attach the report to."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if parent_run:
        parent = retry(lambda: client.get_run(parent_run))
        exp_ids = [parent.info.experiment_id]
        query = f"tags.dsexp.kind = 'job' and tags.mlflow.parentRunId = '{parent_run}'"
    else:
        exp = retry(lambda: client.get_experiment_by_name(experiment))
        if exp is None:
            raise LookupError(f"no MLflow experiment named {experiment!r} in {uri}")
        exp_ids, query = [exp.experiment_id], "tags.dsexp.kind = 'job'"
    runs = retry(lambda: client.search_runs(exp_ids, query, max_results=10000, order_by=["attributes.start_time ASC"]))
    results = [_result_of(client, run, uri) for run in runs]
    parents = {run.data.tags.get("mlflow.parentRunId") for run in runs}
    parent_id = parent_run or (parents.pop() if len(parents) == 1 else None)
    state = None
    if parent_id:
        exp_name = retry(lambda: client.get_experiment(exp_ids[0])).name
        state = {"uri": uri, "experiment": exp_name, "run_id": parent_id}
    return results, state


def _result_of(client, run, uri: str) -> Dict[str, Any]:
    """The run's result.json artifact, else a result rebuilt from params, metrics and tags."""
    rid = run.info.run_id
    with tempfile.TemporaryDirectory() as tmp:
        try:
            path = client.download_artifacts(rid, "result.json", tmp)
            res = read_json(Path(path))
        except Exception:
            res = None
    if res is None:
        res = _rebuild(run)
    res["tracking"] = {"uri": uri, "experiment": run.info.experiment_id, "run_id": rid}
    return res


def _rebuild(run) -> Dict[str, Any]:
    config: Dict[str, Any] = {}
    for key, raw in run.data.params.items():
        node = config
        *path, leaf = key.split(".")
        for part in path:
            node = node.setdefault(part, {})
        node[leaf] = _value(raw)
    metrics, tags = run.data.metrics, run.data.tags
    corr = (
        {
            "logits_rel_err": metrics.get("logits_rel_err"),
            "token_agreement": metrics.get("token_agreement"),
            "passed": bool(metrics["correct"]),
        }
        if "correct" in metrics
        else None
    )
    status = tags.get("dsexp.status", "ok" if metrics.get("ok") else "failed")
    failure = {"cause": tags.get("dsexp.cause"), "message": tags.get("dsexp.error")} if status != "ok" else None
    return {
        "key": tags.get("dsexp.key"),
        "config": config,
        "status": status,
        "failure": failure,
        "headline": {k: metrics.get(k) for k in HEADLINE},
        "metrics": dict(metrics),
        "correctness": corr,
        "runtime": {"device": config.get("device")},
        "ranks": [],
        "job_dir": run.info.run_name,
    }


def _value(raw: str) -> Any:
    """Params are stored as str(value): read numbers, booleans, None and JSON-ish lists/dicts back."""
    for text in (raw, raw.replace("'", '"').replace("None", "null").replace("True", "true").replace("False", "false")):
        try:
            return json.loads(text)
        except ValueError:
            continue
    return raw
