"""dsexp sweeps through a real SLURM cluster on this machine (munged, slurmctld, slurmd: tests/helpers/slurm.py):
the cluster path end to end, SLURM's own faults as recorded results, resume after the sweep process is killed,
and a two-node job on two slurmd. Each job here is a tiny model on CPU; the node has no GPUs.

Run with `python -m pytest -m slurm` (CI does, as root, after `make test`); skipped without SLURM or root.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List

import pytest

from helpers.cluster import comparable, mlflow_server
from helpers.run import run_dsexp, sweep_results

pytestmark = [pytest.mark.slow, pytest.mark.slurm]

SLURM = ["-m", "hydra/launcher=dsexp_slurm", "model=tiny"]
SLEEP_IN_GENERATE = ("debug=fault", "fault={rank:1,phase:generate,kind:sleep}")  # only jobs with tp >= 2 have a rank 1


def dsexp(cluster, args: List[str], cwd: Path, cache: Path, **kw) -> subprocess.CompletedProcess:
    """`python -m dsexp ARGS` as a user on the login node would run it: SLURM's clients see this cluster."""
    return run_dsexp(args, cwd, cache, extra_env=cluster.env_vars, **kw)


def dsexp_background(cluster, args: List[str], cwd: Path, cache: Path) -> subprocess.Popen:
    env = {**os.environ, "DSEXP_CACHE": str(cache), "PYTHONUNBUFFERED": "1", **cluster.env_vars}
    env.pop("MLFLOW_TRACKING_URI", None)
    out = open(cwd / "dsexp.log", "w")
    return subprocess.Popen([sys.executable, "-m", "dsexp", *args], cwd=cwd, env=env, stdout=out, stderr=out)


def wait_for(what: str, check: Callable[[], object], timeout: float = 180, poll: float = 0.3):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"not after {timeout:.0f} s: {what}"
        time.sleep(poll)


def rank_in(job_dir: Path, rank: int, phase: str) -> bool:
    try:
        return json.loads((job_dir / "ranks" / f"rank{rank}.live.json").read_text()).get("phase") == phase
    except (OSError, ValueError):
        return False


def slurm_jobs_of(cluster, cwd: Path) -> Dict[str, List[str]]:
    """{SLURM job id: [each final state the jobcomp file recorded]} for the jobs submitted from cwd."""
    out: Dict[str, List[str]] = {}
    for line in cluster.jobcomp.read_text().splitlines() if cluster.jobcomp.exists() else []:
        rec = cluster_record(line)
        if rec.get("WorkDir") == str(cwd):
            key = f"{rec['ArrayJobId']}_{rec['ArrayTaskId']}" if rec.get("ArrayTaskId") else rec["JobId"]
            out.setdefault(key, []).append(rec["JobState"])
    return out


def cluster_record(line: str) -> Dict[str, str]:
    from helpers.slurm import sc

    return sc.parse_record(line)


def sbatch_flags(sweep: Path, job_id: str) -> Dict[str, object]:
    script = next((sweep / ".submitit").glob(f"{job_id.split('_')[0]}/*_submission.sh")).read_text()
    flags = [line[len("#SBATCH --") :] for line in script.splitlines() if line.startswith("#SBATCH --")]
    return dict(f.split("=", 1) if "=" in f else (f, True) for f in flags)


def test_sweep_on_slurm_matches_the_basic_launcher_and_logs_under_one_parent(
    slurm_cluster, tiny_sweep, tmp_path, cache_dir
):
    """`python -m dsexp -m hydra/launcher=dsexp_slurm tp=1,2 model=tiny tracking.uri=http://...` on the cluster."""
    from mlflow.tracking import MlflowClient

    _, basic_dir, _ = tiny_sweep  # the same sweep with Hydra's basic launcher
    with mlflow_server(tmp_path / "mlserver") as uri:
        t0 = time.monotonic()
        proc = dsexp(
            slurm_cluster, [*SLURM, "tp=1,2", f"tracking.uri={uri}", "hydra.sweep.dir=sw"], tmp_path, cache_dir
        )
        wall = time.monotonic() - t0
        sweep = tmp_path / "sw"
        res = sweep_results(sweep)
        assert [r["status"] for r in res] == ["ok", "ok"], [r.get("failure") for r in res]
        # both ran as SLURM jobs, on this cluster's node, sized per job, without GPUs (the node has none)
        ids = [r["slurm"]["job_id"] for r in res]
        assert len(set(ids)) == 2 and {r["slurm"]["node"] for r in res} == {"n1"}
        assert [r["slurm"]["state"] for r in res] == ["COMPLETED", "COMPLETED"]
        assert slurm_jobs_of(slurm_cluster, tmp_path) == {i: ["COMPLETED"] for i in ids}
        for r, mem in zip(res, ("5GB", "6GB")):
            flags = sbatch_flags(sweep, r["slurm"]["job_id"])
            assert not any("gpu" in f or "gres" in f for f in flags), flags
            assert flags["cpus-per-task"] == "2" and flags["mem"] == mem and flags["no-requeue"] is True
            assert r["slurm"]["submit_to_start_s"] >= 0 and r["slurm"]["sbatch_to_start_s"] > 0
        # the same measurement as with the basic launcher: config, weights per rank, tokens; correct output
        assert sorted(map(comparable, res), key=str) == sorted(map(comparable, sweep_results(basic_dir)), key=str)
        assert all(r["correctness"]["passed"] for r in res)
        assert "slurm_job" in proc.stdout and proc.stdout.count("COMPLETED") >= 2  # the sweep's table
        client = MlflowClient(uri)
        runs = client.search_runs([client.get_experiment_by_name("dsexp").experiment_id])
        parents = [r for r in runs if r.data.tags.get("dsexp.kind") == "sweep"]
        children = [r for r in runs if r.data.tags.get("dsexp.kind") == "job"]
        assert len(parents) == 1 and parents[0].info.status == "FINISHED" and len(children) == 2
        assert {c.data.tags["mlflow.parentRunId"] for c in children} == {parents[0].info.run_id}
        assert {c.data.tags["dsexp.slurm.job_id"] for c in children} == set(ids)
        assert {(c.data.tags["dsexp.slurm.node"], c.data.tags["dsexp.slurm.state"]) for c in children} == {
            ("n1", "COMPLETED")
        }
        assert all("slurm.submit_to_start_s" in c.data.metrics for c in children)
    print(f"\nSLURM sweep tp=1,2: {wall:.1f} s; submit->start {[r['slurm']['submit_to_start_s'] for r in res]} s")


def test_scancel_while_the_ranks_run_is_recorded_and_the_sweep_goes_on(slurm_cluster, tmp_path, cache_dir):
    proc = dsexp_background(
        slurm_cluster, [*SLURM, "tp=2,1", *SLEEP_IN_GENERATE, "hydra.sweep.dir=sw"], tmp_path, cache_dir
    )
    sweep = tmp_path / "sw"
    try:
        wait_for("both ranks of job 0 in generate", lambda: all(rank_in(sweep / "0", r, "generate") for r in (0, 1)))
        jid = wait_for(
            "job 0 in squeue", lambda: slurm_cluster.run("squeue", "-h", "-t", "R", "-o", "%i").stdout.split()
        )
        t_cancel = time.time()
        slurm_cluster.run("scancel", jid[0])
        assert proc.wait(timeout=240) == 0, (tmp_path / "dsexp.log").read_text()[-3000:]
    finally:
        if proc.poll() is None:
            proc.kill()
    cancelled, ok = sweep_results(sweep)
    f = cancelled["failure"]
    assert cancelled["status"] == "failed" and f["cause"] == "slurm_cancelled" and f["job_cause"] == "interrupted"
    assert f["ranks_at_stop"] == {"rank0": "generate", "rank1": "generate"} and f["phase"] == "generate"
    assert f["memory_reached"]["rank1"]["host_rss_gib"] > 0 and "ranks stopped at: rank0 in generate" in f["message"]
    assert cancelled["slurm"]["state"] == "CANCELLED" and cancelled["slurm"]["job_id"] == jid[0]
    assert cancelled["tracking"].get("run_id")  # logged by the sweep process (the job itself could not)
    assert ok["status"] == "ok" and ok["slurm"]["state"] == "COMPLETED"  # the sweep went on
    recorded = cancelled["clock"]["recorded_by_sweep"] - t_cancel
    assert recorded < 30
    assert "failed:slurm_cancelled" in (tmp_path / "dsexp.log").read_text()
    print(f"\nscancel -> recorded by the sweep: {recorded:.1f} s")


def test_node_down_is_recorded_and_a_job_pending_on_it_hits_the_deadline(slurm_cluster, tmp_path, cache_dir):
    args = [*SLURM, "tp=2,1", *SLEEP_IN_GENERATE, "hydra.launcher.pending_deadline_s=5", "hydra.sweep.dir=sw"]
    proc = dsexp_background(slurm_cluster, args, tmp_path, cache_dir)
    sweep = tmp_path / "sw"
    try:
        wait_for("both ranks of job 0 in generate", lambda: all(rank_in(sweep / "0", r, "generate") for r in (0, 1)))
        t_down = time.time()
        slurm_cluster.run("scontrol", "update", "nodename=n1", "state=down", "reason=dsexp-test")
        assert proc.wait(timeout=240) == 0, (tmp_path / "dsexp.log").read_text()[-3000:]
    finally:
        slurm_cluster.run("scontrol", "update", "nodename=n1", "state=resume", check=False)
        if proc.poll() is None:
            proc.kill()
        wait_for("n1 idle again", lambda: slurm_cluster.node_states().get("n1") == "idle", timeout=60)
    lost, stuck = sweep_results(sweep)
    assert lost["failure"]["cause"] == "node_failed" and lost["slurm"]["state"] == "NODE_FAIL"
    assert lost["failure"]["ranks_at_stop"] == {"rank0": "generate", "rank1": "generate"}, lost["failure"]
    assert stuck["failure"]["cause"] == "node_failed" and stuck["slurm"]["state"] == "CANCELLED"
    assert (
        "pending on DOWN/DRAINED nodes" in stuck["failure"]["message"]
        and "before any rank" in stuck["failure"]["message"]
    )
    log = (tmp_path / "dsexp.log").read_text()
    assert log.count("failed:node_failed") == 2  # the end-of-sweep table came out
    print(
        f"\nnode down -> NODE_FAIL recorded: {lost['clock']['recorded_by_sweep'] - t_down:.1f} s; "
        f"pending job cancelled at the deadline: {stuck['clock']['recorded_by_sweep'] - t_down:.1f} s"
    )


def test_slurm_time_limit_is_recorded_and_the_sweep_goes_on(slurm_cluster, tmp_path, cache_dir):
    """timeout_min=1 and no early USR2 (signal_delay_s=0): SLURM's own limit ends the sleeping job (TIMEOUT). One
    CPU a job, so the other job runs meanwhile (its ranks are not slowed: the sleeping job's ranks are idle)."""
    t0 = time.monotonic()
    limits = ["hydra.launcher.timeout_min=1", "hydra.launcher.signal_delay_s=0", "hydra.launcher.cpus_per_task=1"]
    dsexp(slurm_cluster, [*SLURM, "tp=2,1", *SLEEP_IN_GENERATE, *limits, "hydra.sweep.dir=sw"], tmp_path, cache_dir)
    limited, ok = sweep_results(tmp_path / "sw")
    f = limited["failure"]
    assert f["cause"] == "time_limit" and limited["slurm"]["state"] == "TIMEOUT" and f["slurm_state"] == "TIMEOUT"
    assert f["ranks_at_stop"] == {"rank0": "generate", "rank1": "generate"}
    ran = slurm_epoch(limited["slurm"]["end_time"]) - slurm_epoch(limited["slurm"]["start_time"])
    assert 55 <= ran <= 150
    assert ok["status"] == "ok" and ok["slurm"]["state"] == "COMPLETED"
    print(f"\ntime limit: the job ran {ran:.0f} s under a 60 s limit; sweep {time.monotonic() - t0:.0f} s")


def slurm_epoch(stamp: str) -> float:
    from dsexp.job.cluster.slurm import epoch

    return epoch(stamp)


def test_killed_sweep_process_resumes_without_running_any_job_twice(slurm_cluster, tmp_path, cache_dir):
    args = [*SLURM, "tp=1,2", f"tracking.uri=sqlite:///{tmp_path}/mlflow.db", "hydra.sweep.dir=sw"]
    sweep = tmp_path / "sw"
    first = dsexp_background(slurm_cluster, args, tmp_path, cache_dir)
    try:
        wait_for("job 0's ranks running", lambda: (sweep / "0" / "ranks" / "rank0.live.json").exists())
    finally:
        os.kill(first.pid, signal.SIGKILL)  # the sweep process on the login node dies; its SLURM jobs do not
        first.wait()
    queued = slurm_cluster.run("squeue", "-h", "-o", "%i %T").stdout.split("\n")
    again = dsexp(slurm_cluster, args, tmp_path, cache_dir)
    res = sweep_results(sweep)
    assert [r["status"] for r in res] == ["ok", "ok"], [r.get("failure") for r in res]
    ids = [r["slurm"]["job_id"] for r in res]
    # no job ran twice: two SLURM jobs in all, each completed once, each result a first attempt
    assert slurm_jobs_of(slurm_cluster, tmp_path) == {i: ["COMPLETED"] for i in ids}
    assert len(list((sweep / ".submitit").glob("*/*_submitted.pkl"))) == 2
    assert [r["attempt"] for r in res] == [1, 1] and not list(sweep.glob("*/.dsexp/attempts/*"))
    assert again.stdout.count("of an earlier sweep process is still queued or running: waiting") >= 1, queued
    assert all(r["slurm"]["state"] == "COMPLETED" for r in res)
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("dsexp").experiment_id])
    assert sorted(r.data.tags.get("dsexp.kind") for r in runs) == ["job", "job", "sweep"]
    print(f"\nresume: squeue when the sweep process was killed: {[q for q in queued if q]}")


def test_two_node_job_on_two_slurmd(slurm_cluster_2nodes, tmp_path, cache_dir):
    """launcher.nodes=2: one SLURM job on n1 and n2 (two slurmd on this machine); srun starts a torchrun on each."""
    dsexp(slurm_cluster_2nodes, [*SLURM, "tp=2", "launcher.nodes=2", "hydra.sweep.dir=sw"], tmp_path, cache_dir)
    (res,) = sweep_results(tmp_path / "sw")
    assert res["status"] == "ok", res.get("failure")
    assert res["slurm"]["nodelist"] == "n[1-2]" and res["slurm"]["num_nodes"] == 2
    assert sorted(rk["slurm_node"] for rk in res["ranks"]) == ["n1", "n2"]  # one rank on each node
    assert res["launch"]["cmd"][:3] == ["srun", "--overlap", "--nodes=2"] and "--nnodes=2" in res["launch"]["cmd"]
    assert res["correctness"]["passed"]


def test_a_scripts_options_that_the_launcher_has_too_reach_it_under_slurm(slurm_cluster, tmp_path, cache_dir):
    """Issue 46 under SLURM: `--n`, `--max`, `--node`, `--master` reach the script on both ranks as given (the job
    runs dsexp's entry through its launcher inside the allocation: the launcher never parses them)."""
    script = Path(__file__).parent / "data" / "user_scripts" / "launcher_prefixes.py"
    given = ["--n", "3", "--max", "7", "--node", "two words", "--master=x=y", str(tmp_path / "parsed")]
    args = ",".join(f"'{a}'" for a in given)
    dsexp(slurm_cluster, [*SLURM, f"script.path={script}", f"script.args=[{args}]", "tp=2", "check.correctness=false",
                          "hydra.sweep.dir=sw"], tmp_path, cache_dir)  # fmt: skip
    (res,) = sweep_results(tmp_path / "sw")
    assert res["status"] == "ok", res.get("failure")
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"parsed.rank{rank}.json").read_text())
        assert seen["argv"] == [str(script), *given]
        assert seen["args"]["n"] == 3 and seen["args"]["max"] == 7 and seen["args"]["master"] == "x=y"
