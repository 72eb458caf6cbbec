"""End to end on CPU through the cluster path: a sweep in submitit processes logging into a real
`mlflow server` gives the same results as the basic launcher; multi-node jobs on fake nodes."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from dsexp.tracking.runs import read_sweep_state

from helpers.cluster import comparable, fake_slurm_bin, mlflow_server
from helpers.run import run_dsexp, sweep_results

pytestmark = pytest.mark.slow

SWEEP = ["-m", "tp=1,2", "model=tiny"]


def test_submitit_local_sweep_into_an_mlflow_server_matches_the_basic_launcher(tmp_path_factory, cache_dir):
    from mlflow.tracking import MlflowClient

    cwd = tmp_path_factory.mktemp("cluster-sweep")
    run_dsexp([*SWEEP, "hydra.sweep.dir=multirun/basic"], cwd, cache_dir)
    with mlflow_server(cwd / "mlserver") as uri:
        proc = run_dsexp(
            [*SWEEP, "hydra/launcher=dsexp_local", f"tracking.uri={uri}", "hydra.sweep.dir=multirun/sub"],
            cwd,
            cache_dir,
        )
        basic, sub = sweep_results(cwd / "multirun" / "basic"), sweep_results(cwd / "multirun" / "sub")
        assert [r["status"] for r in sub] == ["ok", "ok"], [r.get("failure") for r in sub]
        assert sorted(map(comparable, sub), key=str) == sorted(map(comparable, basic), key=str)
        assert all(r["correctness"]["passed"] for r in sub)
        # each job ran in its own submitit process, sized by its own tp (one array per request)
        logs = sorted((cwd / "multirun" / "sub" / ".submitit").glob("*/*_0_log.out"))
        assert len(logs) == 2 and all("dsexp: ok" in p.read_text() for p in logs)
        assert proc.stdout.count("array of 1: nodes=1") == 2  # Hydra logs to stdout
        assert "tiny/eager/init_inference/bf16/tp2" in proc.stdout  # the end-of-sweep table

        client = MlflowClient(uri)
        exp = client.get_experiment_by_name("dsexp")
        assert exp.artifact_location.startswith("mlflow-artifacts:")
        runs = client.search_runs([exp.experiment_id])
        parents = [r for r in runs if r.data.tags.get("dsexp.kind") == "sweep"]
        children = [r for r in runs if r.data.tags.get("dsexp.kind") == "job"]
        assert len(parents) == 1 and parents[0].info.status == "FINISHED" and len(children) == 2
        assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
        assert {c.info.status for c in children} == {"FINISHED"}
        assert {r["tracking"]["run_id"] for r in sub} == {c.info.run_id for c in children}
        host = socket.gethostname().split(".")[0]
        for child in children:
            assert child.data.metrics[f"generate.node_used_gib.node_{host}"] > 0
            arts = {a.path for a in client.list_artifacts(child.info.run_id, "ranks")}
            assert "ranks/rank0.json" in arts
        assert len(list((cwd / "mlserver" / "artifacts").rglob("rank0.json"))) == 2
        assert read_sweep_state(cwd / "multirun" / "sub")["uri"] == uri  # what the jobs read


def fake_nodes_env(tmp_path: Path, hosts):
    bin_dir = fake_slurm_bin(tmp_path / "bin", hosts)
    return {"PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "SLURM_JOB_NODELIST": "fake[1-2]"}


def test_two_node_torchrun_job_on_fake_nodes(tmp_path, cache_dir):
    """srun starts one torchrun per (fake) node; the c10d rendezvous joins them into one tp=2 job."""
    run_dsexp(
        ["tp=2", "launcher.nodes=2", "model=tiny", "hydra.run.dir=job"],
        tmp_path,
        cache_dir,
        extra_env=fake_nodes_env(tmp_path, ["localhost", "localhost"]),
    )
    res = sweep_results(tmp_path)[0]
    assert res["status"] == "ok", res.get("failure")
    cmd = res["launch"]["cmd"]
    assert cmd[:3] == ["srun", "--overlap", "--nodes=2"] and "--nnodes=2" in cmd and "--nproc-per-node=1" in cmd
    assert sorted((rk["rank"], rk["world_size"]) for rk in res["ranks"]) == [(0, 2), (1, 2)]
    assert res["correctness"]["passed"]
    host = socket.gethostname().split(".")[0]
    assert res["metrics"][f"init.node_used_gib.node_{host}"] > 0


def test_two_node_deepspeed_job_on_fake_nodes(tmp_path, cache_dir):
    """DeepSpeed's runner, with the hostfile written from the allocation, starts both nodes (pdsh).

    Only start/load/init are checked: in generate, DeepSpeed's CPU shared-memory all-reduce assumes all
    ranks share one host (deepspeed.launcher.launch sets LOCAL_SIZE per node) and crashes across
    nodes. On GPUs NCCL does that all-reduce, so this is a CPU-only limit of DeepSpeed.
    """
    run_dsexp(
        ["tp=2", "launcher=deepspeed", "launcher.nodes=2", "model=tiny", "hydra.run.dir=job"],
        tmp_path,
        cache_dir,
        extra_env=fake_nodes_env(tmp_path, ["localhost", "127.0.0.1"]),
    )
    res = sweep_results(tmp_path)[0]
    assert res["launch"]["cmd"][1:3] == ["-m", "deepspeed.launcher.runner"]
    assert (tmp_path / "job" / "hostfile").read_text() == "localhost slots=1\n127.0.0.1 slots=1\n"
    log = (tmp_path / "job" / "launcher.log").read_text()
    assert "pdsh -S -f 1024 -w localhost,127.0.0.1" in log and "export OMP_NUM_THREADS=" in log
    assert "node_rank=0" in log and "node_rank=1" in log
    assert sorted((rk["rank"], rk["world_size"]) for rk in res["ranks"]) == [(0, 2), (1, 2)]
    for rk in res["ranks"]:
        assert {"start", "load", "init"} <= set(rk["phases"]) and rk["phases"]["init"]["weights_device"] > 0
