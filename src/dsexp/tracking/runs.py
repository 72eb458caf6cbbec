"""MLflow: one parent run per sweep, one child run per job. The Hydra job process writes its run; on a cluster the
sweep process adds what only SLURM knows once the job has ended (record_cluster_outcome).

Each job's run holds the flattened config as params, `<phase>.<quantity>.<aggregate>` metrics, the
headline metrics, tags `dsexp.status`/`dsexp.cause`/`dsexp.error` (and `dsexp.slurm.job_id`/`node`/`state`
for a SLURM job), and the job folder (rank JSON and logs) as artifacts. A sqlite store is used by absolute
path, so jobs and sweeps agree on one store.

Several sweeps may share a store: its creation is serialised by a file lock beside the database,
writes retry on lock contention, and a job attempt is logged at most once (runs carry the attempt's
id, so a retried log or `dsexp.sync` finds the run instead of adding a second one). A job retried by
a resumed sweep gets a new child run under the same parent; the earlier attempt's run is tagged
`dsexp.superseded_by=<new run id>`.
"""

from __future__ import annotations

import contextlib
import os
import random
import time
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Optional, TypeVar

from dsexp.core.records import node_shared

T = TypeVar("T")
_READY_STORES: set = set()

MAX_PARAM_LEN = 6000
METRIC_BATCH = 900


OFF = "none"  # tracking.uri=none (tracking=none): no MLflow, results on disk only


def resolve_uri(uri: Optional[str], launch_dir: Optional[Path] = None) -> str:
    """Config value, else $MLFLOW_TRACKING_URI, else sqlite:///<launch dir>/mlflow.db (absolute); OFF stays OFF."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI")
    if not uri:
        return f"sqlite:///{(Path(launch_dir or os.getcwd()) / 'mlflow.db').resolve()}"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        return f"sqlite:///{Path(uri[len('sqlite:///') :]).resolve()}"
    return uri


def artifact_root(uri: str) -> Optional[str]:
    """For a sqlite store, artifacts live beside the database (absolute), not relative to some cwd."""
    if uri.startswith("sqlite:///"):
        return (Path(uri[len("sqlite:///") :]).parent / "mlartifacts").as_uri()
    return None


def retry(fn: Callable[[], T], attempts: int = 8) -> T:
    """Retry sqlite lock contention and creation races (several sweeps may share one store)."""
    for i in range(attempts):
        try:
            return fn()
        except Exception as e:  # mlflow wraps sqlite errors in several types
            text = str(e).lower()
            transient = any(
                s in text
                for s in (
                    "database is locked",
                    "already exists",
                    "unique constraint",
                    "duplicate column",
                    "connection",
                    "timed out",
                    "busy",
                )
            )
            if not transient or i == attempts - 1:
                raise
            time.sleep(0.2 * (2**i) * (0.5 + random.random()))
    raise AssertionError("unreachable")


def check_server(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast if a tracking server does not answer at all (MLflow's own HTTP retries take minutes a call)."""
    import requests

    try:
        requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s)
    except requests.exceptions.SSLError:
        return  # it answers; TLS settings are MLflow's (MLFLOW_TRACKING_INSECURE_TLS, ..._SERVER_CERT_PATH)
    except (requests.ConnectionError, requests.Timeout) as e:
        raise ConnectionError(f"MLflow server {uri} does not answer: {type(e).__name__}") from None


def flatten(d: Dict[str, Any], prefix: str = "") -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out


def ensure_store(uri: str) -> None:
    """Create (or migrate) a sqlite store under a file lock, once per process: concurrent sweeps that
    create the same new database would otherwise race on its schema."""
    if not uri.startswith("sqlite:///") or uri in _READY_STORES:
        return
    from filelock import FileLock
    from mlflow.tracking import MlflowClient

    db = Path(uri[len("sqlite:///") :])
    with FileLock(str(db) + ".lock", timeout=300):
        retry(lambda: MlflowClient(tracking_uri=uri).search_experiments(max_results=1))
    _READY_STORES.add(uri)


EXPERIMENT_KIND = "mlflow.experimentKind"


class Tracker:
    def __init__(self, uri: str, experiment: str):
        from mlflow.tracking import MlflowClient

        ensure_store(uri)
        self.uri = uri
        if uri.startswith(("http://", "https://")):
            check_server(uri)
        self.client = MlflowClient(tracking_uri=uri)
        self.experiment_id = retry(lambda: self._experiment(experiment))

    def _experiment(self, name: str) -> str:
        exp = self.client.get_experiment_by_name(name)
        if exp is not None:
            return exp.experiment_id
        # MLflow 3's UI opens an experiment of unknown kind as GenAI "evaluation runs": say what these runs are
        return self.client.create_experiment(
            name,
            artifact_location=_experiment_artifacts(self.uri, name),
            tags={EXPERIMENT_KIND: "custom_model_development"},
        )

    def start_parent(self, name: str, tags: Dict[str, str]) -> str:
        run = retry(
            lambda: self.client.create_run(self.experiment_id, run_name=name, tags={"dsexp.kind": "sweep", **tags})
        )
        return run.info.run_id

    def set_status(self, run_id: str, status: str) -> None:
        retry(lambda: self.client.update_run(run_id, status=status))

    def find_attempt(self, attempt_id: str):
        """The run already logged for this job attempt, if any."""
        runs = retry(
            lambda: self.client.search_runs(
                [self.experiment_id], f"tags.`dsexp.attempt_id` = '{attempt_id}'", max_results=5
            )
        )
        return runs[0] if runs else None

    def log_job(
        self, result: Dict[str, Any], job_dir: Path, parent_id: Optional[str] = None, run_name: Optional[str] = None
    ) -> str:
        """Log one job attempt as a run; idempotent per attempt (a complete earlier log is returned as is,
        a partial one is replaced)."""
        attempt_id = result.get("attempt_id")
        if attempt_id:
            prior = self.find_attempt(attempt_id)
            if prior is not None and prior.info.status in ("FINISHED", "FAILED"):
                return prior.info.run_id
            if prior is not None:
                retry(lambda: self.client.delete_run(prior.info.run_id))
        tags = {
            "dsexp.kind": "job",
            "dsexp.key": result.get("key", ""),
            "dsexp.attempt": str(result.get("attempt", 1)),
            "dsexp.attempt_id": attempt_id or "",
            **outcome_tags(result),
            **{f"dsexp.{k}": result[k] for k in ("campaign", "commit") if result.get(k)},  # python -m dsexp.campaign
        }
        if parent_id:
            tags["mlflow.parentRunId"] = parent_id
        if node_shared(result):  # packed with other jobs: node-wide figures are theirs too
            tags["dsexp.node_shared"] = "true"
        if (result.get("runtime") or {}).get("shared_gpu"):  # ranks shared GPUs over gloo: times not representative
            tags["dsexp.shared_gpu"] = "true"
        run = retry(lambda: self.client.create_run(self.experiment_id, run_name=run_name, tags=tags))
        rid = run.info.run_id
        self.log_params(rid, {**flatten(result.get("config", {})), **software_params(result)})
        self.log_metrics(rid, job_metrics(result))
        retry(lambda: self.client.log_artifacts(rid, str(job_dir)))
        retry(lambda: self.client.set_terminated(rid, "FINISHED" if result.get("status") == "ok" else "FAILED"))
        return rid

    def log_params(self, run_id: str, params: Dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(k, str(v)[:MAX_PARAM_LEN]) for k, v in sorted(params.items())]
        for chunk in _chunks(items, 90):
            retry(lambda: self.client.log_batch(run_id, params=chunk))

    def log_metrics(self, run_id: str, metrics: Dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(k, float(v), now, 0) for k, v in sorted(metrics.items()) if _finite(v)]
        for chunk in _chunks(items, METRIC_BATCH):
            retry(lambda: self.client.log_batch(run_id, metrics=chunk))

    def log_artifact_dir(self, run_id: str, path: Path, artifact_path: Optional[str] = None) -> None:
        retry(lambda: self.client.log_artifacts(run_id, str(path), artifact_path))

    def log_artifact_as(self, run_id: str, path: Path, name: str) -> None:
        """One file, under another name at the run's artifact root (MLflow keeps a file's own name)."""
        import shutil
        import tempfile

        with tempfile.TemporaryDirectory() as tmp:
            copy = Path(tmp) / name
            shutil.copyfile(path, copy)
            retry(lambda: self.client.log_artifact(run_id, str(copy)))


SLURM_TAGS = ("job_id", "node", "nodelist", "state", "partition")
SLURM_METRICS = ("submit_to_start_s", "sbatch_to_start_s", "sbatch_to_task_s")


def slurm_tags(result: Dict[str, Any]) -> Dict[str, str]:
    """`dsexp.slurm.<job_id|node|nodelist|state|partition>` of a job that ran as a SLURM job."""
    facts = result.get("slurm") or {}
    return {f"dsexp.slurm.{k}": str(facts[k]) for k in SLURM_TAGS if facts.get(k) not in (None, "")}


def slurm_metrics(result: Dict[str, Any]) -> Dict[str, float]:
    """`slurm.<submit_to_start_s|...>`: SLURM's timings of the job, where known."""
    facts = result.get("slurm") or {}
    return {f"slurm.{k}": facts[k] for k in SLURM_METRICS if facts.get(k) is not None}


def outcome_tags(result: Dict[str, Any]) -> Dict[str, str]:
    """How the job ended: `dsexp.status`, its cause and error if it failed, and SLURM's facts."""
    tags = {"dsexp.status": result.get("status", "?")}
    failure = result.get("failure") or {}
    if failure:
        tags["dsexp.cause"] = str(failure.get("cause"))
        tags["dsexp.error"] = str(failure.get("message"))[:4000]
    return {**tags, **slurm_tags(result)}


def software_params(result: Dict[str, Any]) -> Dict[str, Any]:
    """`software.<package>`: the versions rank 0 actually imported, and `software.stack`: the stack's label."""
    versions = (result.get("software") or {}).get("versions") or {}
    stack = ((result.get("runtime") or {}).get("stack") or {}).get("label")
    return {**{f"software.{k}": v for k, v in versions.items()}, **({"software.stack": stack} if stack else {})}


def job_metrics(result: Dict[str, Any]) -> Dict[str, float]:
    """Everything numeric a job run carries: headline, per-phase aggregates, correctness."""
    out = {k: v for k, v in (result.get("headline") or {}).items() if v is not None}
    out.update(result.get("metrics") or {})
    corr = result.get("correctness") or {}
    for k in ("logits_rel_err", "token_agreement"):
        if corr.get(k) is not None:
            out[k] = corr[k]
    if corr:
        out["correct"] = float(bool(corr.get("passed")))
    out["ok"] = float(result.get("status") == "ok")
    out.update(slurm_metrics(result))
    return out


def _experiment_artifacts(uri: str, name: str) -> Optional[str]:
    root = artifact_root(uri)
    return f"{root}/{name}" if root else None


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and v == v and v not in (float("inf"), float("-inf"))


def _chunks(items: List[Any], n: int) -> Iterable[List[Any]]:
    for i in range(0, len(items), n):
        yield items[i : i + n]


# --- sweep state and job logging (used by the Hydra job, the callbacks and dsexp.sync) ---

SWEEP_STATE = Path(".dsexp") / "parent.json"


def read_sweep_state(sweep_dir: Optional[Path]) -> Optional[Dict[str, Any]]:
    if sweep_dir is None:
        return None
    from dsexp.core.fs import read_json

    return read_json(Path(sweep_dir) / SWEEP_STATE)


def ensure_parent(sweep_dir: Path, tracker: Tracker, experiment: str, tags: Dict[str, str]) -> Dict[str, Any]:
    """The sweep's parent run in the tracker's store (made by building the Tracker): the recorded one (a resumed
    sweep reuses it), else a new one."""
    from dsexp.core.fs import write_json_atomic

    state, uri = read_sweep_state(sweep_dir), tracker.uri
    if state and state.get("uri") == uri and state.get("experiment") == experiment:
        return {**state, "created": False}
    run_id = tracker.start_parent(
        f"sweep {Path(sweep_dir).name}", {"dsexp.sweep_dir": str(Path(sweep_dir).resolve()), **tags}
    )
    state = {"uri": uri, "experiment": experiment, "run_id": run_id}
    write_json_atomic(Path(sweep_dir) / SWEEP_STATE, state)
    return {**state, "created": True}


def run_name(config: Dict[str, Any]) -> str:
    from dsexp.analysis.labels import config_label

    return f"{config_label(config)}/tp{config['tp']}"


def track_job(result: Dict[str, Any], job_dir: Path, sweep_dir: Optional[Path], uri: str, experiment: str) -> None:
    """Log one job's result as an MLflow run (child of the sweep's parent run); never raises.

    The outcome (run id, or the error if the store was unreachable) is written back into result.json,
    so `python -m dsexp.sync` can re-log exactly the jobs that are missing.
    """
    from dsexp.core.fs import write_json_atomic

    state = read_sweep_state(sweep_dir)
    if state:
        uri, experiment = state["uri"], state["experiment"]
    if uri == OFF:
        result["tracking"] = {"uri": OFF}
    else:
        result["tracking"] = _log_job(result, job_dir, state, uri, experiment)
    result.setdefault("clock", {})["tracked"] = time.time()
    write_json_atomic(Path(job_dir) / "result.json", result)


def _log_job(result: Dict[str, Any], job_dir: Path, state: Optional[Dict], uri: str, experiment: str) -> Dict:
    """The job as an MLflow run; its tracking record (run id, or the error if the store was unreachable)."""
    try:
        tracker = Tracker(uri, experiment)
        rid = tracker.log_job(result, job_dir, state and state.get("run_id"), run_name(result["config"]))
        for earlier in result.get("earlier_attempts") or []:
            if earlier.get("run_id"):
                with contextlib.suppress(Exception):  # the earlier run may live in another store
                    tracker.client.set_tag(earlier["run_id"], "dsexp.superseded_by", rid)
        return {"uri": uri, "experiment": experiment, "run_id": rid}
    except Exception as e:
        return {"uri": uri, "experiment": experiment, "error": f"{type(e).__name__}: {e}"[:2000]}


def record_cluster_outcome(
    result: Dict[str, Any], job_dir: Path, sweep_dir: Optional[Path], uri: str, experiment: str
) -> None:
    """After a cluster job ended (the sweep process, dsexp.job.cluster.slurm_sweep): bring MLflow up to date with
    what SLURM said. A run the job logged itself gets the SLURM tags and metrics, and its status and cause if
    SLURM's account changed them; a job that could not log (cancelled, its node lost) is logged now. Never
    raises; the outcome goes into result.json["tracking"] as with track_job."""
    from dsexp.core.fs import write_json_atomic

    run_id = (result.get("tracking") or {}).get("run_id")
    if not run_id or uri == OFF:
        track_job(result, job_dir, sweep_dir, uri, experiment)
        return
    state = read_sweep_state(sweep_dir)
    if state:
        uri, experiment = state["uri"], state["experiment"]
    try:
        tracker = Tracker(uri, experiment)
        for k, v in outcome_tags(result).items():
            retry(lambda k=k, v=v: tracker.client.set_tag(run_id, k, v))
        tracker.log_metrics(run_id, slurm_metrics(result))
        if result.get("status") != "ok":
            tracker.set_status(run_id, "FAILED")
        result["tracking"]["slurm_synced"] = time.time()
    except Exception as e:
        result["tracking"]["slurm_sync_error"] = f"{type(e).__name__}: {e}"[:2000]
    write_json_atomic(Path(job_dir) / "result.json", result)
