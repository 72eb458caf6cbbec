"""Reliability building blocks without launching ranks: orphan reaping, failure evidence, partial phases,
checkpoint integrity, resume archive, the sweep's error message."""

from __future__ import annotations

import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate
from dsexp.core.checkpoint import checkpoint_problem
from dsexp.core.fs import read_json, write_json_atomic
from dsexp.core.protocol import TOKEN_ENV
from dsexp.core.records import GIB, with_partial_phase
from dsexp.core.schema import ConfigError
from dsexp.job import teardown
from dsexp.job.failures import classify, hang_site, launcher_exits
from dsexp.job.launch import kill_group
from dsexp.job.run import archive_attempt, find_ok_result

from helpers.run import compose


def test_reap_finds_a_rank_that_left_the_launchers_process_group(tmp_path):
    """torchrun starts workers in their own session: killing its group orphans them; the token finds them."""
    token = teardown.new_token()
    pidfile = tmp_path / "orphan.pid"
    # The "launcher" starts a "worker" in a new session, records its pid, then waits.
    code = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True); "
        f"open({str(pidfile)!r}, 'w').write(str(p.pid)); time.sleep(300)"
    )
    launcher = subprocess.Popen(
        [sys.executable, "-c", code], start_new_session=True, env={**os.environ, TOKEN_ENV: token}
    )
    deadline = time.monotonic() + 30
    while not pidfile.exists() or not pidfile.read_text():
        assert time.monotonic() < deadline
        time.sleep(0.1)
    orphan = int(pidfile.read_text())
    kill_group(launcher.pid, grace_s=2.0, leader=launcher)
    launcher.wait()
    assert psutil.pid_exists(orphan) and [p.pid for p in teardown.job_processes(token)] == [orphan]
    report = teardown.reap(token, grace_s=2.0)
    assert report["survivors"] and report["killed"] and report["left"] == []
    assert teardown.job_processes(token) == []
    assert not psutil.pid_exists(orphan) or psutil.Process(orphan).status() == psutil.STATUS_ZOMBIE


def test_reap_reports_ports_released(tmp_path):
    token = teardown.new_token()
    code = "import socket, time; s = socket.socket(); s.bind(('127.0.0.1', 0)); s.listen(); time.sleep(300)"
    server = subprocess.Popen([sys.executable, "-c", code], env={**os.environ, TOKEN_ENV: token})
    try:
        deadline = time.monotonic() + 30
        while not teardown.listening_ports(teardown.job_processes(token)):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        port = teardown.listening_ports(teardown.job_processes(token))[0]
        assert not teardown.port_free(port)
        report = teardown.reap(token, grace_s=2.0)
        assert report["ports"] == {str(port): True}
    finally:
        server.kill()
        server.wait()


def _rank(r, phases=("start", "load"), status="running", error=None, last_alive=None):
    rec = {"rank": r, "status": status, "error": error, "phases": {p: {"wall_s": 1.0} for p in phases}}
    if last_alive is not None:
        rec["last_alive"] = last_alive
    return rec


def test_victims_of_the_launcher_are_not_blamed():
    # rank 1 exited hard (code 3) in init; rank 0 was SIGTERMed by torchrun while still in load, and died later.
    ranks = [_rank(0, ("start",), last_alive=105.0), _rank(1, ("start", "load"), last_alive=100.0)]
    got = classify(False, 1, ranks, {}, exits={0: -15, 1: 3})
    assert (got["cause"], got["rank"], got["phase"]) == ("rank_crashed", 1, "init")
    assert "exited with code 3" in got["message"]
    # Even if the victim's heartbeat stopped earlier (spinning in a collective), the exit codes decide.
    ranks = [_rank(0, ("start", "load"), last_alive=90.0), _rank(1, ("start",), last_alive=100.0)]
    got = classify(False, 1, ranks, {}, exits={0: -15, 1: -9})
    assert (got["rank"], got["type"]) == (1, "signal") and "SIGKILL" in got["message"]


def test_a_peer_went_away_error_is_collateral():
    err_peer = {
        "phase": "generate",
        "type": "RuntimeError",
        "time": 50.0,
        "message": "[gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:1234",
    }
    ranks = [
        _rank(0, ("start", "load", "init"), error=err_peer, status="failed"),
        _rank(1, ("start", "load", "init"), last_alive=51.0),
    ]
    got = classify(False, 1, ranks, {})
    assert (got["cause"], got["rank"], got["phase"]) == ("rank_crashed", 1, "generate")


def test_sigkill_with_a_full_node_is_host_oom():
    full = _rank(1, ("start",))
    full["phases"]["load"] = {
        "wall_s": 2.0,
        "partial": True,
        "peaks": {"node_used_peak": 98 * GIB},
        "host": {"node_total": 100 * GIB},
    }
    got = classify(False, 1, [_rank(0, ("start",)), full], {}, exits={0: -15, 1: -9})
    assert (got["cause"], got["rank"], got["phase"]) == ("oom_host", 1, "load")
    got = classify(False, 1, [_rank(0, ("start",)), _rank(1, ("start",))], {}, exits={0: -15, 1: -9}, oom_killed=True)
    assert got["cause"] == "oom_host" and "cgroup" in got["message"]
    got = classify(
        False, 1, [_rank(0, ("start",)), _rank(1, ("start",))], {"rank1": "std::bad_alloc"}, exits={0: -15, 1: -6}
    )
    assert got["cause"] == "oom_host" and "SIGABRT" in got["message"]
    got = classify(False, 1, [_rank(0, ("start",)), _rank(1, ("start",))], {}, exits={0: -15, 1: -9})
    assert got["cause"] == "rank_crashed"  # a SIGKILL on a node with room is not taken for an OOM kill


def test_timeout_blames_the_rank_not_waiting_in_a_collective():
    ranks = [_rank(0, ("start", "load", "init")), _rank(1, ("start", "load", "init"))]
    hangs = {0: ("_ops.py:1279 in __call__", True), 1: ("faults.py:38 in maybe_inject", False)}
    got = classify(True, None, ranks, {}, hangs=hangs)
    assert (got["cause"], got["rank"], got["phase"]) == ("timeout", 1, "generate")
    assert "rank 1 in generate at faults.py:38" in got["message"] and "(in a collective)" in got["message"]


def test_hang_site_reads_the_main_thread_of_a_faulthandler_dump():
    dump = """Thread 0x00007f01 (most recent call first):
  File "/x/threading.py", line 331 in wait
  File "/x/dsexp/probes/sampler.py", line 63 in _run

Current thread 0x00007f02 (most recent call first):
  File "/x/torch/distributed/distributed_c10d.py", line 2800 in all_reduce
  File "/x/dsexp/worker.py", line 83 in run_rank
  File "<frozen runpy>", line 198 in _run_module_as_main
"""
    assert hang_site(dump) == ("distributed_c10d.py:2800 in all_reduce", True)
    assert hang_site("no dump here") == (None, False)


def test_launcher_exits_parses_torchruns_summary(tmp_path):
    (tmp_path / "launcher.log").write_text("""Failures:
[1]:
  time      : 2026-11-30_14:38:59
  host      : localhost
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 8490)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  rank      : 1 (local_rank: 1)
  exitcode  : 3 (pid: 8491)
""")
    assert launcher_exits(tmp_path) == {0: -15, 1: 3}


def test_partial_phase_from_the_heartbeat():
    rec = {"rank": 1, "status": "running", "error": None, "phases": {"start": {"wall_s": 1.0}}}
    live = {
        "phase": "load",
        "elapsed_s": 2.5,
        "time": 123.0,
        "peaks": {"host_rss_peak": GIB},
        "host": {"host_rss": GIB},
    }
    got = with_partial_phase(rec, live, 1, 2)
    assert got["phases"]["load"] == {
        "wall_s": 2.5,
        "peaks": {"host_rss_peak": GIB},
        "host": {"host_rss": GIB},
        "partial": True,
    }
    assert got["last_alive"] == 123.0
    # a rank that died before its first record still gets one; a finished rank is left alone
    assert list(with_partial_phase(None, live, 0, 2)["phases"]) == ["load"]
    ok = {"rank": 0, "status": "ok", "phases": {}}
    assert with_partial_phase(ok, live, 0, 2) is ok


def _safetensors(path, n_bytes=16, cut=0):
    header = json.dumps({"w": {"dtype": "F32", "shape": [n_bytes // 4], "data_offsets": [0, n_bytes]}}).encode()
    data = struct.pack("<Q", len(header)) + header + b"\0" * n_bytes
    path.write_bytes(data[: len(data) - cut])


def test_checkpoint_problems_name_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 2}))
    _safetensors(tmp_path / "model-00001-of-00002.safetensors")
    _safetensors(tmp_path / "model-00002-of-00002.safetensors")
    assert checkpoint_problem(tmp_path) is None
    full = (tmp_path / "model-00002-of-00002.safetensors").stat().st_size
    _safetensors(tmp_path / "model-00002-of-00002.safetensors", cut=5)
    assert (
        checkpoint_problem(tmp_path)
        == f"model-00002-of-00002.safetensors is truncated ({full - 5} bytes, its header describes {full})"
    )
    (tmp_path / "model-00002-of-00002.safetensors").write_bytes(struct.pack("<Q", 10) + b"not json!!")
    assert "model-00002-of-00002.safetensors has a corrupt safetensors header" in checkpoint_problem(tmp_path)
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}})
    )
    assert "missing: model-00002-of-00002.safetensors" in checkpoint_problem(tmp_path)
    with pytest.raises(ConfigError, match=r"model.path=.*missing: model-00002-of-00002.safetensors"):
        validate(to_schema(compose(["model=local", f"model.path={tmp_path}"])), gpus=0)


def test_truncated_zip_bin_is_named(tmp_path):
    import torch

    torch.save({"w": torch.zeros(1000)}, tmp_path / "pytorch_model.bin")
    assert checkpoint_problem(tmp_path) is None
    data = (tmp_path / "pytorch_model.bin").read_bytes()
    (tmp_path / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    assert checkpoint_problem(tmp_path).startswith("pytorch_model.bin is truncated")


def test_offload_without_stage3_is_contradictory():
    with pytest.raises(ConfigError, match="zero.offload=cpu needs zero.stage=3"):
        validate(to_schema(compose(["zero.offload=cpu", "zero.stage=2"])), gpus=0)


def test_retry_archives_the_earlier_attempt_and_resume_finds_ok_ones(tmp_path):
    sweep = tmp_path / "sweep"
    job = sweep / "1"
    write_json_atomic(
        job / "result.json",
        {"key": "k1", "status": "failed", "failure": {"cause": "timeout"}, "tracking": {"run_id": "r1"}},
    )
    (job / "ranks").mkdir()
    (job / "ranks" / "rank0.log").write_text("first attempt")
    (job / ".hydra").mkdir()
    earlier = archive_attempt(job)
    assert [(e["status"], e["cause"], e["run_id"]) for e in earlier] == [("failed", "timeout", "r1")]
    assert (job / ".dsexp" / "attempts" / "1" / "ranks" / "rank0.log").read_text() == "first attempt"
    assert not (job / "result.json").exists() and (job / ".hydra").is_dir()
    # an ok result that was later moved aside still counts for resume
    write_json_atomic(
        job / ".dsexp" / "attempts" / "1" / "result.json", {"key": "k1", "status": "ok", "job_dir": str(job)}
    )
    assert find_ok_result(sweep, "k1")["status"] == "ok" and find_ok_result(sweep, "k2") is None


def test_multirun_names_the_allowed_options_of_an_unknown_group_option(tmp_path, cache_dir):
    from helpers.run import run_dsexp

    proc = run_dsexp(["-m", "model=tiny,huge", "hydra.sweep.dir=multirun/u"], tmp_path, cache_dir, check=False)
    assert proc.returncode == 2
    assert "[model=huge] In 'config': Could not find 'model/huge'; choose one of:" in proc.stderr
    assert "tiny" in proc.stderr.split("choose one of:")[1]
    assert not (tmp_path / "multirun" / "u" / "0").exists()  # nothing was launched
    single = run_dsexp(["model=huge"], tmp_path, cache_dir, check=False)
    assert single.returncode == 1 and "Available options in 'model'" in single.stderr


def test_stack_signal_is_not_fatal_to_a_rank_that_registered_it():
    code = (
        "import faulthandler, signal, sys, time; faulthandler.register(signal.SIGUSR1, all_threads=True); "
        "print('ready', flush=True); time.sleep(2); print('alive', flush=True)"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    proc.send_signal(signal.SIGUSR1)
    out, err = proc.communicate(timeout=30)
    assert "alive" in out and "most recent call first" in err


def test_resume_skips_ok_jobs_unless_rerun_and_retries_keep_the_earlier_attempt(tmp_path, monkeypatch):
    from dsexp.job import run as jobmod

    executed = []

    def fake_execute(spec, job_dir, result):
        executed.append(job_dir)
        result["status"] = "ok"

    monkeypatch.setattr(jobmod, "_execute", fake_execute)
    sweep = tmp_path / "sweep"
    first = jobmod.run_job(validate(to_schema(compose(["check.correctness=false"]))), sweep / "0", sweep)
    assert executed == [sweep / "0"] and first["attempt"] == 1
    again = jobmod.run_job(validate(to_schema(compose(["check.correctness=false"]))), sweep / "0", sweep)
    assert executed == [sweep / "0"] and again["resumed_from"] == str(sweep / "0")  # skipped, not executed
    assert again["attempt_id"] == first["attempt_id"] and not (sweep / "0" / ".dsexp" / "attempts").exists()
    forced = jobmod.run_job(validate(to_schema(compose(["check.correctness=false", "rerun=true"]))), sweep / "0", sweep)
    assert len(executed) == 2 and forced["attempt"] == 2
    assert forced["earlier_attempts"][0]["status"] == "ok"
    assert read_json(sweep / "0" / ".dsexp" / "attempts" / "1" / "result.json")["attempt_id"] == first["attempt_id"]


def test_a_rank_that_received_sigterm_is_a_victim_even_if_its_heartbeat_stopped_first():
    """DeepSpeed's launcher prints no per-rank exit codes; a rank spinning in the CPU shm all-reduce holds the GIL,
    so its heartbeat stops before the culprit dies. Its SIGTERM stack file marks it as stopped by the launcher."""
    ranks = [_rank(0, ("start",), last_alive=90.0), _rank(1, ("start",), last_alive=100.0)]
    assert classify(False, 1, ranks, {})["rank"] == 0  # heartbeats alone blame the wrong rank
    got = classify(False, 1, ranks, {}, terminated=[0])
    assert (got["rank"], got["phase"], got["cause"]) == (1, "load", "rank_crashed")


def test_worker_sigterm_leaves_its_stacks_and_still_dies(tmp_path):
    code = (
        "import os, re; from pathlib import Path; from dsexp.rank import output; out = os.fdopen(os.dup(1), 'w'); "
        f"output.redirect_output(Path({str(tmp_path)!r}) / 'ranks' / 'rank0.log'); "
        "print('ready', file=out, flush=True); re.match(r'(a+)+$', 'a' * 40 + 'b')"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.5)  # now spinning in C code, holding the GIL
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == -signal.SIGTERM
    finally:
        proc.kill()
        proc.wait()
    stacks = (tmp_path / "ranks" / "rank0.terminated").read_text()
    assert "most recent call first" in stacks and "in match" in stacks


def test_release_shm_removes_only_this_jobs_segments(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    monkeypatch.setattr(teardown, "SHM_DIR", str(shm))
    uid = os.getuid()
    mine = [shm / f"deepspeed_allreduce_buffer_{uid}_localhost_29500_{r}" for r in (0, 1)]
    other = shm / f"deepspeed_allreduce_buffer_{uid}_localhost_29501_0"
    for f in mine + [other]:
        f.write_bytes(b"x")
    write_json_atomic(tmp_path / "job" / "ranks" / "rank0.json", {"rank": 0, "master": "localhost:29500"})
    assert teardown.release_shm(tmp_path / "job") == sorted(f.name for f in mine)
    assert not any(f.exists() for f in mine) and other.exists()


def test_retry_first_stops_ranks_an_earlier_attempt_left_running(tmp_path):
    """The job process of the earlier attempt was SIGKILLed, so its teardown never ran; the retry cleans up."""
    job = tmp_path / "sweep" / "3"
    orphan = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(300)", "-m", "dsexp.rank.worker", str(job)]
    )
    other = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import time; time.sleep(300)",
            "-m",
            "dsexp.rank.worker",
            str(tmp_path / "sweep" / "31"),
        ]
    )
    try:
        time.sleep(0.5)
        assert teardown.reap_stale(job, grace_s=2.0) == [f"{orphan.pid}:{sys.executable}"]
        assert orphan.wait(timeout=10) is not None and other.poll() is None
    finally:
        for p in (orphan, other):
            p.kill()
            p.wait()


def test_a_launcher_that_never_started_a_rank_is_a_launch_error():
    got = classify(False, 1, [None, None], {"launcher": "usage: torchrun ...\nerror: unrecognized arguments: --bogus"})
    assert (got["cause"], got["rank"]) == ("launch_error", None) and "unrecognized arguments" in got["message"]


def test_a_multirun_job_that_fails_validation_at_run_time_is_a_failed_result(tmp_path):
    from dsexp.compose.config import plain
    from dsexp.job.run import record_invalid

    res = record_invalid(
        plain(compose(["tp=2"])), tmp_path / "0", "device=cuda but no GPU is visible (NVML found none)"
    )
    assert read_json(tmp_path / "0" / "result.json") == res
    assert (res["status"], res["failure"]["cause"], res["config"]["tp"]) == ("failed", "invalid_config", 2)
