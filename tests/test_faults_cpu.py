"""Fault injection on CPU: one multirun where rank 1 of a tp=2 job fails in a chosen way per job.

Each fault must become a failed result with the right cause, rank and phase; the sweep must finish
(on_multirun_end prints its table and closes the MLflow parent run); no process of the sweep may
survive; and running the same command again must skip the ok job and retry only the failed ones.
The faults are `once: true` (transient), so the retries succeed.

The default test runs a subset (no fault, sigkill; a raising rank is in test_tracking_reliability's
end-to-end test). The slow test runs every fault kind and
writes the table in results/cpu/fault_matrix.md and in docs/reliability.md.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Dict, List, Optional

import psutil
import pytest

from dsexp.job import teardown
from dsexp.job.run import ATTEMPTS

from helpers.run import ROOT, run_dsexp, sweep_results
from helpers.tables import publish

# (fault, expected cause, expected phase); rank 1 of 2 always.
FAST = [(None, "ok", None), ({"phase": "init", "kind": "sigkill"}, "rank_crashed", "init")]
FULL = [
    (None, "ok", None),
    ({"phase": "load", "kind": "raise"}, "load_error", "load"),
    ({"phase": "init", "kind": "exit"}, "rank_crashed", "init"),
    ({"phase": "load", "kind": "sigkill"}, "rank_crashed", "load"),
    ({"phase": "generate", "kind": "sleep"}, "timeout", "generate"),
    ({"phase": "load", "kind": "alloc_host", "cap_mb": 256}, "oom_host", "load"),
]
MATRIX = ROOT / "results" / "cpu" / "fault_matrix.md"
pytestmark = pytest.mark.timeout(2400)  # whole sweeps, run twice; a busy 2-core machine is slow


def fault_arg(fault: Optional[dict]) -> str:
    if fault is None:
        return "null"
    return "{" + ",".join(f"{k}:{v}" for k, v in {"rank": 1, **fault, "once": "true"}.items()) + "}"


def sweep_processes(sweep_dir: Path, results: List[dict]) -> List[str]:
    """Processes left from this sweep: carrying one of its job tokens, or naming its folder."""
    left = []
    for res in results:
        token = (res.get("teardown") or {}).get("token")
        left += [f"{p.pid} (token)" for p in teardown.job_processes(token)] if token else []
    for p in psutil.process_iter(["pid", "cmdline"]):
        if any(str(sweep_dir) in part for part in p.info["cmdline"] or []):
            left.append(f"{p.pid}: {' '.join(p.info['cmdline'])}")
    return left


def run_twice(tmp_path: Path, cache_dir: Path, faults, timeout_s: float) -> Dict[str, object]:
    """The fault sweep, then the same command again (resume)."""
    sweep_dir = tmp_path / "multirun" / "faults"
    args = [
        "-m",
        "tp=2",
        "check.correctness=false",
        f"timeout_s={timeout_s}",
        "hydra.sweep.dir=multirun/faults",
        "debug=fault",
        "fault=" + ",".join(fault_arg(f) for f, _, _ in faults),
    ]
    out: Dict[str, object] = {"sweep_dir": sweep_dir}
    for tag in ("first", "rerun"):
        proc = run_dsexp(args, tmp_path, cache_dir, timeout=3000)
        results = sweep_results(sweep_dir)
        out[tag] = {"stdout": proc.stdout, "results": results, "left": sweep_processes(sweep_dir, results)}
    return out


def check_sweep(run: Dict[str, object], faults) -> None:
    import mlflow

    first, rerun = run["first"], run["rerun"]
    results = first["results"]
    assert len(results) == len(faults)
    for res, (fault, cause, phase) in zip(results, faults):
        if fault is None:
            assert res["status"] == "ok", res.get("failure")
            continue
        f = res["failure"]
        assert (res["status"], f["cause"], f["rank"], f["phase"]) == ("failed", cause, 1, phase), f["message"]
        assert set(f["log_tails"]) == {"rank0", "rank1", "launcher"}
        assert f["memory_reached"]["rank1"]["host_rss_gib"] > 0.05  # measured up to the failure
    # the sweep went on to the end: the end-of-sweep table lists every job, the parent run is closed
    for res, (fault, cause, _) in zip(results, faults):
        assert ("ok" if fault is None else f"failed:{cause}") in first["stdout"]
    assert first["left"] == [] and rerun["left"] == []
    # the rerun: the ok job is skipped untouched, every failed one is retried (and, the fault being transient, ok)
    again = rerun["results"]
    skipped = rerun["stdout"].count("dsexp: skipped, already ok")
    assert skipped == 1
    for before, after, (fault, cause, _) in zip(results, again, faults):
        if fault is None:
            assert after["attempt_id"] == before["attempt_id"] and "earlier_attempts" in after
            assert after["earlier_attempts"] == []
        else:
            assert after["attempt"] == 2 and after["status"] == "ok", after.get("failure")
            assert [(e["status"], e["cause"]) for e in after["earlier_attempts"]] == [("failed", cause)]
            assert Path(after["earlier_attempts"][0]["dir"], "result.json").is_file()
    # MLflow: one parent (reused by the rerun), a run per attempt, failed attempts point at their retry
    mlflow.set_tracking_uri(f"sqlite:///{Path(run['sweep_dir']).parents[1] / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["dsexp"])
    parents = runs[runs["tags.dsexp.kind"] == "sweep"]
    jobs = runs[runs["tags.dsexp.kind"] == "job"]
    n_failed = len(faults) - 1
    assert len(parents) == 1 and parents["status"].iloc[0] == "FINISHED"
    assert len(jobs) == len(faults) + n_failed and set(jobs["tags.mlflow.parentRunId"]) == set(parents["run_id"])
    superseded = jobs[jobs["tags.dsexp.superseded_by"].notna()]
    assert len(superseded) == n_failed and set(superseded["tags.dsexp.status"]) == {"failed"}
    assert set(superseded["tags.dsexp.superseded_by"]) == {r["tracking"]["run_id"] for r in again[1:]}


@pytest.fixture(scope="module")
def fast_run(tmp_path_factory, cache_dir):
    return run_twice(tmp_path_factory.mktemp("faults"), cache_dir, FAST, timeout_s=900)


def test_fault_subset_sweep_classifies_tears_down_and_resumes(fast_run):
    check_sweep(fast_run, FAST)


def test_hard_death_keeps_the_phase_it_died_in(fast_run):
    """rank 1 is SIGKILLed at the start of init: no Python error, yet its record has the init phase (partial,
    from its heartbeat) and the memory it had reached; rank 0, SIGTERMed by torchrun, was last seen alive too."""
    res = fast_run["first"]["results"][1]
    assert "SIGKILL" in res["failure"]["message"] and res["failure"]["type"] == "signal"
    rank0, rank1 = res["ranks"]
    init = rank1["phases"]["init"]
    assert init["partial"] and init["host"]["host_rss"] > 0 and rank1["last_alive"]
    assert res["metrics"]["init.host_rss_gib.rank1"] > 0 and res["metrics"]["load.host_rss_gib.rank1"] > 0
    assert rank0["last_alive"] and rank0["status"] != "ok"
    assert res["failure"]["ranks_at_stop"]["rank1"] == "init"


def test_a_killed_ranks_curve_and_trace_survive_it(fast_run):
    """The failed job's series and trace come from what its ranks left: rank 1's curve runs to its last heartbeat
    (it died entering init), and its track in trace.json ends with the init it died in, partial."""
    res = fast_run["first"]["results"][1]
    rank1, series1 = res["ranks"][1], res["series"][1]
    died = rank1["last_alive"] - rank1["clock"]["t0"]
    load_end = next(e["t1"] for e in rank1["timeline"] if e["phase"] == "load")
    last = series1["points"][-1][0]
    assert load_end <= last <= died + 0.01 and died - last < 1.0  # flushed at every heartbeat (0.5 s)
    assert res["series"][0]["points"][-1][0] > load_end  # rank 0, stopped by the launcher, left its curve too
    # the rerun archived this attempt's files with it
    trace = json.loads((Path(res["job_dir"]) / ATTEMPTS / "1" / res["trace"]).read_text())
    pid1 = next(e["pid"] for e in trace["traceEvents"] if e["ph"] == "M" and e["args"].get("name") == "rank 1")
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X" and e["pid"] == pid1]
    assert [s["name"] for s in slices] == ["start", "load", "init"] and slices[-1]["args"]["partial"] is True
    counters = [e for e in trace["traceEvents"] if e["ph"] == "C" and e["pid"] == pid1]
    values = sum(v is not None for p in series1["points"] for v in p[1:])  # the node's figure: full readings only
    assert len(counters) == values and max(c["ts"] for c in counters) >= slices[1]["ts"]


def matrix_rows(run: Dict[str, object], faults) -> List[List[str]]:
    rows = []
    first, again = run["first"]["results"], run["rerun"]["results"]
    for res, after, (fault, cause, phase) in zip(first, again, faults):
        f = res.get("failure") or {}
        reached = (f.get("memory_reached") or {}).get("rank1", {})
        kind = (
            "none"
            if fault is None
            else f"{fault['kind']}" + (f" ({fault['cap_mb']} MB cap)" if "cap_mb" in fault else "")
        )
        message = re.sub(r"\s+", " ", str(f.get("message", "")))[:160].replace("|", "/")
        retry = (
            "skipped (ok)"
            if after.get("earlier_attempts") == [] and fault is None
            else f"retried: {after['status']} (attempt {after.get('attempt')})"
        )
        rows.append(
            [
                kind,
                phase or "-",
                cause,
                f.get("cause", res["status"]) if f else "ok",
                "-" if not f else f"rank {f.get('rank')} / {f.get('phase')}",
                message or "-",
                f"{reached['host_rss_gib']:.2f}" if reached.get("host_rss_gib") else "-",
                f"{res['wall_s']:.0f}",
                teardown_cell(res, run["first"]["left"]),
                retry,
            ]
        )
    return rows


def teardown_cell(res: dict, left: List[str]) -> str:
    td = res.get("teardown") or {}
    ports = td.get("ports") or {}
    shm = len(td.get("shm_removed") or [])
    cell = f"{len(td.get('survivors') or [])} reaped, {len(left)} left, {shm} shm segments removed"
    return cell + (f", {sum(ports.values())}/{len(ports)} ports free" if ports else "")


def write_matrix(rows: List[List[str]]) -> str:
    head = [
        "fault on rank 1",
        "phase",
        "expected",
        "recorded cause",
        "blamed rank / phase",
        "message",
        "rank 1 host RSS reached (GiB)",
        "job wall (s)",
        "teardown",
        "same command again",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    table = "\n".join(lines) + "\n"
    return publish(
        table,
        MATRIX,
        "tests/test_faults_cpu.py::test_full_fault_matrix",
        "fault-matrix",
        ROOT / "docs" / "reliability.md",
    )


@pytest.mark.slow
def test_full_fault_matrix(tmp_path, cache_dir):
    run = run_twice(tmp_path, cache_dir, FULL, timeout_s=90)
    check_sweep(run, FULL)
    hang = run["first"]["results"][4]
    assert hang["teardown"]["stacks_dumped"] == 2 and "faults.py" in hang["failure"]["message"]
    assert all(hang["teardown"]["ports"].values())  # the ports the job listened on are free again
    table = write_matrix(matrix_rows(run, FULL))
    assert table.count("\n") == len(FULL) + 2


def test_sigterm_to_the_sweep_tears_its_ranks_down(tmp_path, cache_dir):
    """The job process itself is stopped (scancel, a supervisor): its ranks must not outlive it."""
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    env = {**os.environ, "DSEXP_CACHE": str(cache_dir)}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dsexp",
            "tp=2",
            "check.correctness=false",
            "timeout_s=600",
            "debug=fault",
            "fault={rank:1,phase:load,kind:sleep}",
            "hydra.run.dir=out",
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    live = tmp_path / "out" / "ranks" / "rank1.live.json"
    deadline = time.monotonic() + 600
    try:  # wait until rank 1 hangs in load
        while not (live.is_file() and json.loads(live.read_text() or "{}").get("phase") == "load"):
            assert proc.poll() is None and time.monotonic() < deadline, "the job ended or never reached load"
            time.sleep(0.5)
    finally:
        proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0
    res = json.loads((tmp_path / "out" / "result.json").read_text())
    assert res["status"] == "failed" and res["failure"]["cause"] == "interrupted", out[-2000:]
    assert sweep_processes(tmp_path / "out", [res]) == []
    # it ends in words, not in a traceback of dsexp's own (seen on the H200 when a campaign's step was stopped)
    assert "dsexp: stopped (signal SIGTERM)" in out and "Traceback" not in out, out[-3000:]
