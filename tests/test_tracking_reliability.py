"""MLflow safety: concurrent writers into one new sqlite store lose no run; `dsexp.sync` logs what the store
missed, exactly once."""

from __future__ import annotations

import os
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

import pytest

from dsexp.compose.config import to_schema
from dsexp.core.fs import read_json, write_json_atomic

from helpers.run import compose, run_dsexp, sweep_results

SRC = Path(__file__).resolve().parents[1] / "src"


def fake_sweep(sweep_dir: Path, n: int, tag: str) -> None:
    """n finished jobs whose tracking failed (as when the store was unreachable during the sweep)."""
    config = asdict(to_schema(compose()))
    for i in range(n):
        job = sweep_dir / str(i)
        (job / "ranks").mkdir(parents=True)
        (job / "ranks" / "rank0.log").write_text(f"job {i}\n")
        write_json_atomic(
            job / "result.json",
            {
                "key": f"{tag}-{i}",
                "attempt_id": f"{tag}-{i}-a1",
                "attempt": 1,
                "status": "ok",
                "config": config,
                "headline": {"load_s": 1.0 + i},
                "metrics": {"load.wall_s.max": 1.0 + i},
                "tracking": {
                    "uri": "sqlite:////unreachable/mlflow.db",
                    "experiment": "dsexp",
                    "error": "OperationalError",
                },
            },
        )


def runs_of(uri: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    exp = client.get_experiment_by_name("conc")
    return client.search_runs([exp.experiment_id], max_results=1000)


def sync(sweep_dir: Path, uri: str, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    return subprocess.Popen(
        [sys.executable, "-m", "dsexp.sync", str(sweep_dir), "--uri", uri, *extra],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_four_concurrent_writers_into_a_new_store_lose_no_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    sweeps = [tmp_path / f"s{k}" for k in range(4)]
    for k, s in enumerate(sweeps):
        fake_sweep(s, 4, f"s{k}")
    procs = [sync(s, uri, "--experiment", "conc") for s in sweeps]  # all race to create the store
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, outs
    runs = runs_of(uri)
    parents = {r.info.run_id: r for r in runs if r.data.tags.get("dsexp.kind") == "sweep"}
    children = [r for r in runs if r.data.tags.get("dsexp.kind") == "job"]
    assert len(parents) == 4 and len(children) == 16
    assert {r.data.tags["mlflow.parentRunId"] for r in children} == set(parents)
    for s in sweeps:
        ids = {res["tracking"]["run_id"] for res in sweep_results(s)}
        assert len(ids) == 4 and all(i in {r.info.run_id for r in children} for i in ids)
        assert read_json(s / ".dsexp" / "parent.json")["run_id"] in parents


def test_sync_logs_only_what_is_missing_and_never_twice(tmp_path):
    from mlflow.tracking import MlflowClient

    from dsexp.tracking.relog import main, sync_sweep
    from dsexp.tracking.runs import Tracker

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    sweep = tmp_path / "sweep"
    fake_sweep(sweep, 3, "j")
    # job 2's first log attempt died half-way: its run exists but was never terminated
    tracker = Tracker(uri, "conc")
    half = tracker.client.create_run(tracker.experiment_id, tags={"dsexp.attempt_id": "j-2-a1", "dsexp.kind": "job"})
    assert sync_sweep(sweep, uri, "conc") == {
        "logged": [str(sweep / "0"), str(sweep / "1"), str(sweep / "2")],
        "already": [],
        "failed": [],
    }
    assert main([str(sweep), "--uri", uri, "--experiment", "conc"]) == 0  # second run: nothing to do
    runs = runs_of(uri)
    jobs = [r for r in runs if r.data.tags.get("dsexp.kind") == "job"]
    assert len(jobs) == 3 and half.info.run_id not in {r.info.run_id for r in jobs}
    assert MlflowClient(tracking_uri=uri).get_run(half.info.run_id).info.lifecycle_stage == "deleted"
    assert sorted(r.data.metrics["load_s"] for r in jobs) == [1.0, 2.0, 3.0]
    # a job whose run id got lost from result.json (crash after logging) is found by its attempt id, not re-logged
    res = read_json(sweep / "0" / "result.json")
    rid = res["tracking"]["run_id"]
    res["tracking"] = {"error": "lost"}
    write_json_atomic(sweep / "0" / "result.json", res)
    assert sync_sweep(sweep, uri, "conc")["logged"] == [str(sweep / "0")]
    assert read_json(sweep / "0" / "result.json")["tracking"]["run_id"] == rid and len(runs_of(uri)) == 4


def test_sweep_with_unreachable_store_completes_and_sync_logs_it_later(tmp_path, cache_dir):
    """End to end: the store's folder cannot be created during the sweep (a file is in the way)."""
    blocker = tmp_path / "store"
    blocker.write_text("not a folder")
    uri = f"sqlite:///{blocker / 'mlflow.db'}"
    proc = run_dsexp(
        [
            "-m",
            "tp=1",
            "check.correctness=false",
            "debug=fault",
            "fault={rank:0,phase:start,kind:raise}",
            f"tracking.uri={uri}",
            "hydra.sweep.dir=multirun/s",
        ],
        tmp_path,
        cache_dir,
    )
    sweep = tmp_path / "multirun" / "s"
    (res,) = sweep_results(sweep)
    assert res["status"] == "failed" and res["failure"]["cause"] == "engine_error"
    assert "run_id" not in res["tracking"] and res["tracking"]["error"]
    assert "python -m dsexp.sync" in proc.stderr  # said at start and again at the end
    blocker.unlink()
    blocker.mkdir()
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    out = subprocess.run([sys.executable, "-m", "dsexp.sync", str(sweep)], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and "1 logged, 0 already logged, 0 failed" in out.stdout, out.stderr
    again = subprocess.run([sys.executable, "-m", "dsexp.sync", str(sweep)], env=env, capture_output=True, text=True)
    assert "0 logged, 1 already logged, 0 failed" in again.stdout
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("dsexp").experiment_id])
    kinds = sorted(r.data.tags["dsexp.kind"] for r in runs)
    assert kinds == ["job", "sweep"]
    job = next(r for r in runs if r.data.tags["dsexp.kind"] == "job")
    assert job.data.tags["dsexp.cause"] == "engine_error" and job.info.status == "FAILED"


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_four_concurrent_sweeps_into_one_store(tmp_path, cache_dir):
    """Four real multiruns (tiny model, tp=1, two jobs each) writing into one store at once."""
    env = {**os.environ, "DSEXP_CACHE": str(cache_dir), "PYTHONPATH": str(SRC)}
    env.pop("MLFLOW_TRACKING_URI", None)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "dsexp",
                "-m",
                "generate.new_tokens=4,8",
                "check.correctness=false",
                f"tracking.uri={uri}",
                "tracking.experiment=conc",
                f"hydra.sweep.dir=multirun/s{k}",
            ],
            cwd=tmp_path,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for k in range(4)
    ]
    outs = [p.communicate(timeout=1200) for p in procs]
    assert [p.returncode for p in procs] == [0] * 4, [o[1][-2000:] for o in outs]
    runs = runs_of(uri)
    children = [r for r in runs if r.data.tags.get("dsexp.kind") == "job"]
    assert len([r for r in runs if r.data.tags.get("dsexp.kind") == "sweep"]) == 4 and len(children) == 8
    assert {r.info.status for r in children} == {"FINISHED"}
    for k in range(4):
        results = sweep_results(tmp_path / "multirun" / f"s{k}")
        assert [r["status"] for r in results] == ["ok", "ok"]
        assert all(r["tracking"]["run_id"] in {c.info.run_id for c in children} for r in results)
