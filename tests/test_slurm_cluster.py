"""The real SLURM test cluster (tests/helpers/slurm_cluster.py and slurm.py): start, jobs, faults, stop.

Skipped (with the reason) without Debian's slurm-wlm/munge or without root; CI installs them with
.ci/install-slurm.sh and runs them with `python -m pytest -m slurm` (the fixtures are in conftest.py). SLURM's
time limit (TIMEOUT 55-150 s after a 1-minute limit) is checked through a dsexp sweep, in
tests/test_slurm_sweep.py::test_slurm_time_limit_is_recorded_and_the_sweep_goes_on, so CI waits for it once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers.slurm import sc, skip_reason

pytestmark = pytest.mark.slurm
needs_slurm = pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")


def wait_running(cluster, job_id, timeout=30):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rec = cluster.job_record(job_id) or {}
        if rec.get("JobState") == "RUNNING":
            return rec
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} not running after {timeout}s: {cluster.job_record(job_id)}")


def test_sbatch_records_id_node_and_final_state(slurm_cluster, tmp_path):
    out = tmp_path / "out.txt"
    job = slurm_cluster.sbatch(f"--output={out}", "--wrap", "echo $SLURM_JOB_ID $SLURMD_NODENAME $SLURM_JOB_NODELIST")
    rec = slurm_cluster.wait_final(job, timeout=60)
    assert rec["JobState"] == "COMPLETED" and rec["NodeList"] == "n1" and rec["ExitCode"] == "0:0"
    assert out.read_text().split() == [job, "n1", "n1"]
    assert slurm_cluster.final_state(job) == "COMPLETED"
    assert f"JobId={job} " in slurm_cluster.jobcomp.read_text()  # kept for good, without slurmdbd
    shim = slurm_cluster.run("sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job).stdout
    assert shim.splitlines() == ["JobID|State|NodeList", f"{job}|COMPLETED|n1"]


def test_scancel_of_a_running_job_is_cancelled(slurm_cluster):
    job = slurm_cluster.sbatch("--output=/dev/null", "--wrap", "sleep 300")
    wait_running(slurm_cluster, job)
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_final(job, timeout=30)["JobState"] == "CANCELLED"


def test_node_down_ends_a_no_requeue_job_as_node_fail(slurm_cluster):
    job = slurm_cluster.sbatch("--output=/dev/null", "--no-requeue", "--wrap", "sleep 300")
    node = wait_running(slurm_cluster, job)["NodeList"]
    try:
        slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=test")
        assert slurm_cluster.wait_final(job, timeout=30)["JobState"] == "NODE_FAIL"
    finally:
        slurm_cluster.run("scontrol", "update", f"nodename={node}", "state=resume")
    deadline = time.monotonic() + 30
    while slurm_cluster.node_states().get(node) != "idle":
        assert time.monotonic() < deadline, slurm_cluster.node_states()
        time.sleep(0.5)


def test_impossible_requests_are_refused_at_submit(slurm_cluster):
    for args in (["--gpus-per-node=1"], ["--gres=gpu:1"], ["--cpus-per-task=99"], ["--mem=100000G"], ["--nodes=2"]):
        proc = slurm_cluster.run("sbatch", *args, "--output=/dev/null", "--wrap", "true", check=False)
        assert proc.returncode != 0 and "error" in proc.stderr, (args, proc.stdout)


def test_job_records_read_the_jobcomp_file_when_slurmctld_forgot(tmp_path):
    # no cluster at all here: scontrol fails, the records come from jobcomp.txt (the last line of a job wins)
    (tmp_path / "jobcomp.txt").write_text(
        "JobId=7 UserId=root(0) Name=wrap JobState=REQUEUED NodeList=n1 SubmitTime=2026-01-01T00:00:00 ExitCode=0:0\n"
        "JobId=7 UserId=root(0) Name=wrap JobState=NODE_FAIL NodeList=n2 WorkDir=/a b SubmitTime=2026-01-01T00:00:00\n"
        "JobId=9 UserId=root(0) Name=x JobState=TIMEOUT NodeList=n1 ArrayJobId=8 ArrayTaskId=1 ExitCode=0:15\n"
    )
    rec = sc.job_record("7", tmp_path)
    assert rec["JobState"] == "NODE_FAIL" and rec["NodeList"] == "n2" and rec["WorkDir"] == "/a b"
    assert rec["Source"] == "jobcomp"
    assert sc.final_state("8_1", tmp_path) == "TIMEOUT" and sc.final_state("9", tmp_path) == "TIMEOUT"
    assert [sc._key(r) for r in sc.job_records("8", tmp_path)] == ["8_1"]
    assert sc.final_state("10", tmp_path) is None


def test_two_slurmd_on_one_machine(slurm_cluster_2nodes, tmp_path):
    assert slurm_cluster_2nodes.node_states() == {"n1": "idle", "n2": "idle"}
    out = tmp_path / "out.txt"
    job = slurm_cluster_2nodes.sbatch(
        f"--output={out}",
        "--nodes=2",
        "--ntasks-per-node=1",
        "--wrap",
        "srun bash -c 'echo $SLURM_PROCID $SLURMD_NODENAME'",
    )
    rec = slurm_cluster_2nodes.wait_final(job, timeout=60)
    assert rec["JobState"] == "COMPLETED" and rec["NodeList"] == "n[1-2]"
    assert sorted(out.read_text().splitlines()) == ["0 n1", "1 n2"]


@needs_slurm
def test_ports_in_use_are_refused(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(sc.ClusterError, match="already in use"):
            sc.start_cluster(tmp_path / "c", port=port)
    assert not (tmp_path / "c").exists()


@needs_slurm
def test_cli_start_status_stop_leaves_nothing(tmp_path):
    d = tmp_path / "cli"
    port = next(p for p in range(17817, 18817, 100) if not any(sc._port_taken(q) for q in (p, p + 1)))
    cli = [sys.executable, str(sc.__file__)]
    up = subprocess.run(
        [*cli, "start", "--dir", str(d), "--port", str(port)], capture_output=True, text=True, timeout=90
    )
    assert up.returncode == 0, up.stderr
    assert f"export SLURM_CONF={d / 'slurm.conf'}" in up.stdout
    cluster = sc.Cluster.load(d)
    pids = [p["pid"] for p in cluster.processes]
    assert [p["name"] for p in cluster.processes] == ["munged", "slurmctld", "slurmd-n1"]
    try:
        job = cluster.sbatch("--output=/dev/null", "--wrap", "sleep 300")  # running when stop comes
        wait_running(cluster, job)
        status = subprocess.run([*cli, "status", "--dir", str(d)], capture_output=True, text=True, timeout=30)
        assert status.returncode == 0 and "'n1': 'mixed'" in status.stdout, status.stdout
    finally:
        down = subprocess.run([*cli, "stop", "--dir", str(d)], capture_output=True, text=True, timeout=120)
    assert down.returncode == 0, down.stderr
    assert f"cancelled jobs {job}" in down.stdout
    assert not d.exists()
    time.sleep(0.5)
    assert not [p for p in pids if Path(f"/proc/{p}").exists()]
    assert not cluster._stepds()


@pytest.mark.skipif(skip_reason() is not None, reason=skip_reason() or "")
def test_submitit_sees_the_final_state_through_the_sacct_shim(slurm_cluster, tmp_path, monkeypatch):
    submitit = pytest.importorskip("submitit")
    for k, v in slurm_cluster.env_vars.items():
        monkeypatch.setenv(k, v)
    ex = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    ex.update_parameters(timeout_min=5)
    job = ex.submit(os.getpid)
    assert isinstance(job.result(), int)
    job = ex.submit(time.sleep, 300)
    wait_running(slurm_cluster, job.job_id)
    job.cancel()
    with pytest.raises(submitit.core.utils.UncompletedJobError, match="CANCELLED"):
        job.result()
    assert slurm_cluster.final_state(job.job_id) == "CANCELLED"
