"""The Hydra app behind `python -m dsexp [-m] key=value ...`: one Hydra job per experiment, which validates its
config, runs the job (dsexp.job.run: it spawns its own ranks) and logs it to MLflow."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from dsexp.compose.config import conf_dir  # importing it registers the schema with Hydra


@hydra.main(version_base="1.3", config_path=conf_dir(), config_name="config")
def main(cfg: DictConfig):
    entered = time.time()  # the job's clock starts when Hydra hands over (composition is done)
    from dsexp.compose.config import plain, to_schema
    from dsexp.compose.validate import validate
    from dsexp.core.schema import ConfigError
    from dsexp.job.cluster.multinode import is_first_task
    from dsexp.job.run import record_invalid, run_job
    from dsexp.tracking.runs import resolve_uri, track_job

    if not is_first_task():  # submitit's task on another node of a multi-node job: task 0 starts every rank
        return None
    hc = HydraConfig.get()
    job_dir = Path(hc.runtime.output_dir)
    sweep_dir = Path(hc.sweep.dir) if hc.mode == RunMode.MULTIRUN else None
    try:
        spec = validate(to_schema(cfg))
    except ConfigError as e:
        if sweep_dir is None:
            sys.exit(f"dsexp: bad config: {e}")
        result = record_invalid(plain(cfg), job_dir, str(e))  # a multirun goes on
    else:
        if sweep_dir is None:  # a single run: a stack that cannot be prepared stops it here (a sweep: at its start)
            _prepare_stack_or_exit(spec)
        result = run_job(spec, job_dir, sweep_dir)
    if result.get("resumed_from"):
        print(f"dsexp: skipped, already ok in {result['resumed_from']} (rerun=true forces a rerun)")
        return result.get("headline")
    result.setdefault("clock", {})["task"] = entered
    track_job(result, job_dir, sweep_dir, resolve_uri(cfg.tracking.uri, Path(hc.runtime.cwd)), cfg.tracking.experiment)
    failure = result.get("failure") or {}
    print(
        f"dsexp: {result['status']}"
        + (f" ({failure.get('cause')}: {failure.get('message')})" if failure else "")
        + f" -> {job_dir / 'result.json'}"
    )
    return result.get("headline")


def _prepare_stack_or_exit(spec) -> None:
    from dsexp.job.overlay import StackError, prepare_stack

    try:
        prepare_stack(spec.stack, spec.cache_dir)
    except StackError as e:
        sys.exit(f"dsexp: bad stack: {e}")
