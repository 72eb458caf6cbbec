"""Cluster path without a cluster: the SLURM/local launcher presets, the sbatch script submitit would
write, the multi-node rank commands, per-node metrics, and tracking into a real `mlflow server`."""

from __future__ import annotations

import math
import os
import time

import pytest

from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate, validate_nodes
from dsexp.core import records
from dsexp.core.schema import ConfigError
from dsexp.job.cluster import multinode

from helpers.cluster import fake_slurm_bin, mlflow_server
from helpers.run import compose

SLURM = ["hydra/launcher=dsexp_slurm", "hydra.launcher.partition=gpu"]


@pytest.fixture(autouse=True)
def no_slurm_controller(monkeypatch):
    """SLURM's answers are the test's own here (a cluster may be up on this machine): by default sinfo knows
    nothing, so requests are as configured."""
    from dsexp.job.cluster import slurm

    monkeypatch.setattr(slurm, "partition_nodes", lambda partition=None, fresh=False: None)


def cpu_partition(monkeypatch, cpus=2, mem_mb=24105, gpus=0, nodes=1):
    """sinfo answers: `nodes` nodes of `cpus` CPUs, `mem_mb` MiB and `gpus` GPUs (this machine's, by default)."""
    from dsexp.job.cluster import slurm

    info = [
        {"name": f"n{i + 1}", "partition": "debug", "cpus": cpus, "mem_mb": mem_mb, "gpus": gpus, "state": "idle"}
        for i in range(nodes)
    ]
    monkeypatch.setattr(slurm, "partition_nodes", lambda partition=None, fresh=False: info)


def launcher_params(*overrides):
    from dsexp.compose.launchers import launcher_params

    return launcher_params(compose(list(overrides), hydra=True))


def sbatch_script(params, monkeypatch, map_count=None) -> str:
    """The sbatch file submitit would submit for these launcher params (no `srun` needed here)."""
    import submitit.slurm.slurm as slurm

    from hydra_plugins.dsexp_launcher.dsexp_launcher import DsexpSlurmLauncher

    monkeypatch.setattr(slurm.SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # "srun is installed"
    executor = DsexpSlurmLauncher(**params).executor(params)._executor
    if map_count:
        executor.parameters["map_count"] = map_count
    return executor._make_submission_file_text(executor._submitit_command_str, "uid")


def sbatch_flags(script: str) -> dict:
    flags = [line[len("#SBATCH --") :] for line in script.splitlines() if line.startswith("#SBATCH --")]
    return dict(f.split("=", 1) if "=" in f else (f, True) for f in flags)


@pytest.mark.parametrize("tp,nodes,gpus", [(1, 1, 1), (4, 1, 4), (8, 2, 4), (16, 4, 4)])
def test_slurm_preset_asks_for_tp_gpus_per_job(tp, nodes, gpus, tmp_path):
    p = launcher_params(*SLURM, f"tp={tp}", f"launcher.nodes={nodes}", f"hydra.sweep.dir={tmp_path}")
    assert (p["gpus_per_node"], p["nodes"], p["tasks_per_node"]) == (gpus, nodes, 1)
    assert p["partition"] == "gpu" and p["submitit_folder"].startswith(str(tmp_path))


def test_slurm_preset_defaults_leave_partition_and_account_to_the_cluster(tmp_path, monkeypatch):
    params = launcher_params("hydra/launcher=dsexp_slurm", "tp=2", f"hydra.sweep.dir={tmp_path}")
    assert params["partition"] is None and params["account"] is None
    flags = sbatch_flags(sbatch_script(params, monkeypatch))
    assert "partition" not in flags and "account" not in flags and flags["gpus-per-node"] == "2"
    assert compose(["hydra/launcher=dsexp_slurm"], hydra=True).hydra.launcher._target_.endswith("DsexpSlurmLauncher")


@pytest.mark.parametrize("tp,nodes", [(4, 1), (8, 2)])
def test_sbatch_script_has_the_job_resources(tp, nodes, tmp_path, monkeypatch):
    params = launcher_params(
        *SLURM,
        f"tp={tp}",
        f"launcher.nodes={nodes}",
        "hydra.launcher.timeout_min=45",
        "hydra.launcher.account=proj1",
        f"hydra.sweep.dir={tmp_path}",
    )
    script = sbatch_script(params, monkeypatch)
    flags = sbatch_flags(script)
    assert flags["gpus-per-node"] == str(tp // nodes) and flags["nodes"] == str(nodes)
    assert flags["ntasks-per-node"] == "1" and flags["partition"] == "gpu"
    assert flags["time"] == "45" and flags["account"] == "proj1" and flags["job-name"] == "dsexp"
    assert "array" not in flags
    srun_line = [line for line in script.splitlines() if line.startswith("srun ")]
    assert len(srun_line) == 1 and "submitit.core._submit" in srun_line[0]


def test_sbatch_script_array_setup_and_extra_options(tmp_path, monkeypatch):
    params = launcher_params(
        *SLURM,
        "tp=2",
        "hydra.launcher.mem_gb=64",
        "+hydra.launcher.additional_parameters.exclusive=true",
        "hydra.launcher.setup=[source .venv/bin/activate]",
        f"hydra.sweep.dir={tmp_path}",
    )
    script = sbatch_script(params, monkeypatch, map_count=3)
    flags = sbatch_flags(script)
    assert flags["array"] == "0-2%3" and flags["exclusive"] is True and flags["mem"] == "64GB"
    lines = script.splitlines()
    assert lines.index("source .venv/bin/activate") < next(i for i, s in enumerate(lines) if s.startswith("srun "))


def test_local_preset_gives_each_job_tp_gpus(tmp_path):
    p = launcher_params("hydra/launcher=dsexp_local", "tp=2", f"hydra.sweep.dir={tmp_path}")
    assert (p["gpus_per_node"], p["nodes"], p["tasks_per_node"]) == (2, 1, 1)
    cfg = compose(["hydra/launcher=dsexp_local"], hydra=True)
    assert cfg.hydra.launcher._target_.endswith("DsexpLocalLauncher")


@pytest.mark.parametrize("launcher", ["dsexp_local", "dsexp_slurm"])
def test_hydra_finds_the_launcher_class_the_preset_names(launcher):
    """Hydra instantiates only plugins it registered, under `<__module__>.<name>` inside hydra_plugins."""
    from hydra.core.plugins import Plugins

    target = compose([f"hydra/launcher={launcher}"], hydra=True).hydra.launcher._target_
    assert target.startswith("hydra_plugins.") and target in Plugins.instance().class_name_to_class


def test_sweep_validation_counts_the_gpus_slurm_will_give():
    """On a login node (no GPU here) a GPU-only setting is valid when the SLURM preset asks for GPUs."""
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from dsexp.compose.sweep import validate_sweep

    from helpers.run import CONF

    job = ["tp=2", "engine.kernel_inject=true", "dtype=fp16"]
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        on_slurm = validate_sweep(hcompose("config", overrides=SLURM + job, return_hydra_config=True))
        here = validate_sweep(hcompose("config", overrides=job, return_hydra_config=True))
        uneven = validate_sweep(
            hcompose("config", overrides=SLURM + ["tp=3", "launcher.nodes=2"], return_hydra_config=True)
        )
    assert on_slurm == []
    assert len(here) == 1 and "on device=cpu" in here[0][1]  # fp16 or kernel injection, whichever is checked first
    assert len(uneven) == 1 and "launcher.nodes=2" in uneven[0][1]


def composed(*overrides):
    """The JobConfig as composed, not validated (validation would ask this machine's GPUs)."""
    return to_schema(compose(list(overrides)))


@pytest.mark.parametrize(
    "overrides,needle",
    [
        (["tp=3", "launcher.nodes=2"], "does not split evenly"),
        (["launcher.hostfile=/etc/hostname"], "DeepSpeed launcher only"),
        (["launcher=deepspeed", "launcher.hostfile=/nonexistent/hostfile"], "does not exist"),
    ],
)
def test_multinode_settings_are_checked(overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        validate(composed(*overrides), gpus=0)


@pytest.fixture
def allocation(tmp_path, monkeypatch):
    """A fake 2-node SLURM allocation: SLURM_JOB_NODELIST and a `scontrol` that expands it."""
    bin_dir = fake_slurm_bin(tmp_path / "bin", ["gpu-a1", "gpu-a2"])
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-a[1-2]")
    monkeypatch.setenv("SLURM_CPUS_ON_NODE", "32")
    return tmp_path


def test_torchrun_multinode_command(allocation):
    import sys

    job_dir = allocation / "job"
    spec = composed("tp=8", "launcher.nodes=2")
    assert multinode.slurm_hosts() == ["gpu-a1", "gpu-a2"]
    assert multinode.rank_command(spec, job_dir, 29511, {"OMP_NUM_THREADS": "8"}) == [
        "srun",
        "--overlap",
        "--nodes=2",
        "--ntasks=2",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--cpus-per-task=32",
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes=2",
        "--nproc-per-node=4",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu-a1:29511",
        "--rdzv-id=dsexp-job-29511",
        "-m",
        "dsexp.rank.worker",
        str(job_dir),
    ]


def test_deepspeed_multinode_command_from_the_allocation(allocation):
    import sys

    job_dir = allocation / "job"
    job_dir.mkdir()
    spec = composed("launcher=deepspeed", "tp=8", "launcher.nodes=2")
    cmd = multinode.rank_command(spec, job_dir, 29512, {"OMP_NUM_THREADS": "8", "DS_ACCELERATOR": "cuda"})
    assert cmd == [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(job_dir / "hostfile"),
        "--num_nodes",
        "2",
        "--num_gpus",
        "4",
        "--master_addr",
        "gpu-a1",
        "--master_port",
        "29512",
        "--no_local_rank",
        "--module",
        "dsexp.rank.worker",
        str(job_dir),
    ]
    assert (job_dir / "hostfile").read_text() == "gpu-a1 slots=4\ngpu-a2 slots=4\n"
    assert multinode.hostfile_hosts(job_dir / "hostfile") == {"gpu-a1": 4, "gpu-a2": 4}
    # the runner exports these to the other nodes (it reads .deepspeed_env from its cwd, the job folder)
    assert (job_dir / ".deepspeed_env").read_text() == "DS_ACCELERATOR=cuda\nOMP_NUM_THREADS=8\n"


def test_deepspeed_multinode_command_from_a_given_hostfile(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# two boxes\nbox7 slots=8\nbox9 slots=8\n")
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    spec = composed("launcher=deepspeed", "tp=8", "launcher.nodes=2", f"launcher.hostfile={hostfile}")
    validate_nodes(spec)
    cmd = multinode.rank_command(spec, job_dir, 29513, {})
    assert cmd[cmd.index("--hostfile") + 1] == str(hostfile) and cmd[cmd.index("--master_addr") + 1] == "box7"
    assert cmd[cmd.index("--num_gpus") + 1] == "4" and not (job_dir / "hostfile").exists()


def test_torchrun_multinode_outside_slurm_says_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NODELIST", raising=False)
    monkeypatch.delenv("SLURM_NODELIST", raising=False)
    with pytest.raises(RuntimeError, match="needs a SLURM allocation"):
        multinode.rank_command(composed("tp=2", "launcher.nodes=2"), tmp_path, 29514, {})


def test_only_the_first_submitit_task_runs_the_job(monkeypatch):
    monkeypatch.delenv("SUBMITIT_EXECUTOR", raising=False)
    assert multinode.is_first_task()
    monkeypatch.setenv("SUBMITIT_EXECUTOR", "slurm")
    for rank, first in (("0", True), ("1", False)):
        monkeypatch.setenv("SLURM_PROCID", rank)
        assert multinode.is_first_task() is first


def rank_record(rank, host, used_gib):
    g = 2**30
    phase = {
        "wall_s": 1.0,
        "host": {"host_rss": g, "node_used": used_gib * g},
        "peaks": {"node_used_peak": (used_gib + 1) * g},
    }
    return {"rank": rank, "hostname": host, "phases": {"load": phase}}


def test_per_node_metrics_next_to_the_per_rank_ones():
    ranks = [rank_record(0, "gpu-a1.cluster", 10), rank_record(1, "gpu-a1.cluster", 12), rank_record(2, "gpu-a2", 30)]
    m = records.aggregate_metrics(ranks)
    assert m["load.node_used_gib.node_gpu-a1"] == 12 and m["load.node_used_gib.node_gpu-a2"] == 30
    assert m["load.node_used_peak_gib.node_gpu-a1"] == 13 and m["load.node_used_peak_gib.node_gpu-a2"] == 31
    assert m["load.node_used_gib.max"] == 30 and m["load.node_used_gib.rank1"] == 12  # existing names unchanged
    assert not any(k.endswith("node_gpu-a1") and "host_rss" in k for k in m)


def test_unreachable_tracking_server_fails_fast():
    from dsexp.job.launch import free_port
    from dsexp.tracking.runs import Tracker

    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match="does not answer"):
        Tracker(f"http://127.0.0.1:{free_port()}", "dsexp")
    assert time.monotonic() - t0 < 30


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlserver")
    with mlflow_server(root) as uri:
        yield uri, root


def test_http_store_takes_job_runs_and_serves_their_artifacts(server, tmp_path):
    from mlflow.tracking import MlflowClient

    from dsexp.tracking.runs import Tracker

    uri, root = server
    job_dir = tmp_path / "job"
    (job_dir / "ranks").mkdir(parents=True)
    (job_dir / "ranks" / "rank0.json").write_text('{"rank": 0}')
    result = {
        "status": "ok",
        "key": "k1",
        "config": {"tp": 2, "model": {"name": "tiny"}},
        "headline": {"load_s": 1.5},
        "metrics": {"load.node_used_gib.node_gpu-a1": 3.0},
    }
    tracker = Tracker(uri, "dsexp-http")
    parent = tracker.start_parent("sweep s", {})
    rid = tracker.log_job(result, job_dir, parent, "tiny/tp2")
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("dsexp-http")
    assert exp.artifact_location.startswith("mlflow-artifacts:")  # the server stores and serves artifacts
    run = client.get_run(rid)
    assert run.info.status == "FINISHED" and run.data.tags["mlflow.parentRunId"] == parent
    assert run.data.metrics["load.node_used_gib.node_gpu-a1"] == 3.0 and run.data.params["model.name"] == "tiny"
    assert [a.path for a in client.list_artifacts(rid, "ranks")] == ["ranks/rank0.json"]
    stored = list((root / "artifacts").rglob("rank0.json"))
    assert len(stored) == 1 and stored[0].read_text() == '{"rank": 0}'


# --- SLURM on nodes without GPUs: sizing, requeue, what the sweep process records (dsexp.job.cluster.slurm) ---


def slurm_request(*overrides):
    from dsexp.compose.launchers import slurm_request

    return slurm_request(compose(["hydra/launcher=dsexp_slurm", *overrides], hydra=True))


@pytest.mark.parametrize("tp,cpus,mem", [(1, "2", "5GB"), (2, "2", "6GB")])
def test_sbatch_on_a_partition_without_gpus_asks_for_none_and_sizes_cpus_and_memory(
    tp, cpus, mem, tmp_path, monkeypatch
):
    cpu_partition(monkeypatch)  # this machine: 2 CPUs, 24105 MiB, no GRES
    params, problems = slurm_request(f"tp={tp}", "model=tiny", f"hydra.sweep.dir={tmp_path}")  # device=auto
    assert problems == [] and params["gpus_per_node"] is None
    script = sbatch_script(params, monkeypatch)
    flags = sbatch_flags(script)
    assert not any("gpu" in f or "gres" in f for f in flags), flags
    assert flags["cpus-per-task"] == cpus and flags["mem"] == mem  # tp + 1 CPUs, capped at the node's 2
    assert flags["no-requeue"] is True  # a requeued measurement would run twice
    lines = script.splitlines()
    assert lines.index("export DSEXP_SLURM_STARTED=$(date +%s.%N)") < next(
        i for i, line in enumerate(lines) if line.startswith("srun ")
    )


def test_slurm_sizing_without_sinfo_follows_the_config(tmp_path):
    from dsexp.job.cluster.slurm_sweep import checkpoint_gib

    cpu = slurm_request("tp=4", "device=cpu", f"hydra.sweep.dir={tmp_path}")[0]
    assert (cpu["gpus_per_node"], cpu["cpus_per_task"], cpu["mem_gb"]) == (None, 5, 8)  # 3 + 4 * (1 + ~0)
    gpu = slurm_request("tp=4", "model=internlm2_20b_shapes", f"hydra.sweep.dir={tmp_path}")[0]
    weights = checkpoint_gib(compose(["model=internlm2_20b_shapes"]).model)
    assert weights == pytest.approx(37.74, rel=0.03)  # the README's figure for these shapes
    assert gpu["gpus_per_node"] == 4 and gpu["mem_gb"] == math.ceil(3 + weights + 4 * (1 + weights))
    requeue = slurm_request("hydra.launcher.requeue=true", f"hydra.sweep.dir={tmp_path}")[0]
    assert "no-requeue" not in requeue["additional_parameters"]


def test_slurm_defaults_are_capped_and_explicit_requests_are_checked_against_the_nodes(tmp_path, monkeypatch):
    cpu_partition(monkeypatch, cpus=4, mem_mb=16000)
    big = slurm_request("tp=8", "model=internlm2_20b_shapes", "device=cpu", f"hydra.sweep.dir={tmp_path}")
    assert (big[0]["cpus_per_task"], big[0]["mem_gb"], big[1]) == (4, 15, [])  # defaults: capped at the node
    params, problems = slurm_request(
        "hydra.launcher.cpus_per_task=8", "hydra.launcher.mem_gb=64", "launcher.nodes=2", "tp=2", "device=cuda"
    )
    assert len(problems) == 4, problems
    assert "cpus_per_task=8: the largest node of partition debug (the default) has 4 CPUs" in problems[0]
    assert "mem_gb=64" in problems[1] and "at most mem_gb=15" in problems[1]
    assert "gpus_per_node=1" in problems[2] and "no GPUs" in problems[2] and "device=cpu" in problems[2]
    assert "nodes=2" in problems[3] and "1 node(s)" in problems[3]


def test_sweep_is_refused_before_submitting_what_no_node_has(monkeypatch):
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from dsexp.compose.sweep import validate_sweep

    from helpers.run import CONF

    cpu_partition(monkeypatch)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        ok = validate_sweep(
            hcompose("config", overrides=["hydra/launcher=dsexp_slurm", "tp=2"], return_hydra_config=True)
        )
        bad = validate_sweep(
            hcompose(
                "config",
                overrides=["hydra/launcher=dsexp_slurm", "tp=1", "hydra.launcher.cpus_per_task=3"],
                return_hydra_config=True,
            )
        )
    assert ok == [] and len(bad) == 1 and "cpus_per_task=3" in bad[0][1] and "has 2 CPUs" in bad[0][1]


def test_slurm_facts_from_the_job_environment():
    from dsexp.job.cluster import slurm

    env = {
        "SLURM_JOB_ID": "14",
        "SLURM_ARRAY_JOB_ID": "12",
        "SLURM_ARRAY_TASK_ID": "2",
        "SLURMD_NODENAME": "n1",
        "SLURM_JOB_NODELIST": "n[1-2]",
        "DSEXP_SLURM_STARTED": "1700000000.25",
    }
    facts = slurm.env_facts(env)
    assert facts["job_id"] == "12_2" and facts["raw_job_id"] == 14 and facts["node"] == "n1"
    assert facts["nodelist"] == "n[1-2]" and facts["started_at"] == 1700000000.25
    assert slurm.env_facts({}) is None
    assert slurm.gres_gpus("gpu:h100:8(S:0-1),shard:4") == 8 and slurm.gres_gpus("(null)") == 0


def slurm_record(state, **extra):
    return {
        "JobId": "7",
        "JobState": state,
        "NodeList": "n1",
        "SubmitTime": "2026-01-01T00:00:00",
        "StartTime": "2026-01-01T00:00:03",
        "EndTime": "2026-01-01T00:01:00",
        "ExitCode": "0:15",
        "Reason": "None",
        **extra,
    }


def test_slurm_times_submit_to_start_and_sbatch_to_start():
    from dsexp.job.cluster import slurm

    started = slurm.epoch("2026-01-01T00:00:03") + 0.4
    f = slurm.facts(slurm_record("COMPLETED"), started - 5.0, {"job_id": "7", "started_at": started}, started + 2)
    assert f["submit_to_start_s"] == 3.0 and f["sbatch_to_start_s"] == pytest.approx(5.0)
    assert f["sbatch_to_task_s"] == pytest.approx(7.0) and f["state"] == "COMPLETED" and f["reason"] is None
    never = slurm.facts(slurm_record("CANCELLED", NodeList="(null)"), None, {"job_id": "7"})
    assert "submit_to_start_s" not in never  # cancelled while pending: SLURM's StartTime is its end


def test_how_slurm_ended_a_job_becomes_its_cause():
    from dsexp.job.cluster import slurm

    reached = {"ranks_at_stop": {"rank0": "generate", "rank1": "generate"}, "memory_reached": {"rank0": {}}}
    interrupted = {"status": "failed", "failure": {"cause": "interrupted", "type": "Interrupted", "message": "x"}}
    out = slurm.merge_outcome(interrupted, {"job_id": "7", "state": "CANCELLED"}, reached)
    f = out["failure"]
    assert (f["cause"], f["job_cause"], f["slurm_state"], f["phase"]) == (
        "slurm_cancelled",
        "interrupted",
        "CANCELLED",
        "generate",
    )
    assert "rank0 in generate" in f["message"] and out["slurm"]["state"] == "CANCELLED"
    assert slurm.merge_outcome(None, {"state": "NODE_FAIL"}, {"ranks_at_stop": {}})["failure"]["cause"] == "node_failed"
    assert slurm.merge_outcome(None, {"state": "TIMEOUT"}, {})["failure"]["cause"] == "time_limit"
    timed_out = "FailedJobError: ... UncompletedJobError: Job not requeued because: timed-out too many times."
    assert slurm.merge_outcome(None, {"state": "FAILED"}, {}, timed_out)["failure"]["cause"] == "time_limit"
    assert slurm.merge_outcome(None, {"state": "FAILED"}, {})["failure"]["cause"] == "slurm_failed"
    late = slurm.merge_outcome(None, {"state": "CANCELLED"}, {}, deadline="pending on DOWN nodes for 900 s")
    assert late["failure"]["cause"] == "node_failed" and late["failure"]["message"].startswith("pending on DOWN")
    ok = {"status": "ok", "headline": {"load_s": 1.0}}
    assert slurm.merge_outcome(ok, {"state": "CANCELLED"}, reached)["status"] == "ok"  # measured before the end
    own = {"status": "failed", "failure": {"cause": "load_error", "message": "bad file"}}
    assert slurm.merge_outcome(own, {"state": "COMPLETED"}, reached)["failure"] == own["failure"]


def test_submitits_time_limit_error_is_a_time_limit():
    from dsexp.job import failures
    from dsexp.job.cluster import slurm
    from dsexp.job.run import _preparation_cause

    class UncompletedJobError(Exception):
        pass

    e = UncompletedJobError("Job not requeued because: timed-out too many times.")
    assert slurm.is_time_limit_error(e) and _preparation_cause(e) == "time_limit"
    assert {"slurm_cancelled", "node_failed", "time_limit", "slurm_failed", "slurm_rejected"} <= set(failures.CAUSES)


def test_earlier_submissions_are_found_from_submitits_pickles(tmp_path):
    from submitit.core.utils import DelayedSubmission

    from dsexp.job.cluster.slurm_sweep import earlier_submissions

    folder = tmp_path / ".submitit"
    for jid, num in (("12_0", 0), ("12_1", 3), ("15", 3)):
        (folder / jid).mkdir(parents=True)
        DelayedSubmission(print, ["tp=1"], "hydra.sweep.dir", num, f"job_id_for_{num}", {}).dump(
            folder / jid / f"{jid}_submitted.pkl"
        )
    (folder / "12").mkdir()
    (folder / "12" / "12_submission.sh").write_text("#!/bin/bash\n")
    found = earlier_submissions(str(folder / "%j"))
    assert {n: [jid for jid, _ in subs] for n, subs in found.items()} == {0: ["12_0"], 3: ["12_1", "15"]}
    assert found[0][0][1] == (folder / "12" / "12_submission.sh").stat().st_mtime  # the sbatch call


def test_sweep_table_shows_slurm_job_node_and_state():
    from dsexp.compose.callbacks import format_table

    res = {
        "job_dir": "/s/0",
        "status": "failed",
        "failure": {"cause": "node_failed"},
        "config": {"tp": 2, "model": {"name": "tiny"}},
        "slurm": {"job_id": "12_0", "node": "n1", "state": "NODE_FAIL", "submit_to_start_s": 3.0},
    }
    table = format_table([res])
    assert "slurm_job" in table.splitlines()[0] and "12_0" in table and "NODE_FAIL" in table
    assert "failed:node_failed" in table and "slurm_job" not in format_table([{**res, "slurm": None}])


def test_a_partition_slurm_does_not_have_is_refused_before_submitting(monkeypatch):
    from dsexp.job.cluster import slurm

    monkeypatch.setattr(slurm, "partition_nodes", lambda partition=None, fresh=False: [])
    monkeypatch.setattr(slurm, "partitions", lambda: ["debug", "gpu"])
    problems = slurm_request("hydra.launcher.partition=nope")[1]
    assert problems == [
        "hydra.launcher.partition=nope: SLURM has no such partition (or it has no nodes); sinfo lists: debug, gpu"
    ]
