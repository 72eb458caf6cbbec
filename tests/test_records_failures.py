"""Aggregation over ranks and failure classification, on constructed rank records."""

from __future__ import annotations

from dsexp.core.records import GIB, aggregate_metrics, headline
from dsexp.job.failures import classify


def rank(r, load_rss, weights, gpu_peak=None, status="ok", error=None, phases=("start", "load", "init", "generate")):
    ph = {
        p: {"wall_s": 1.0 + r, "host": {"host_rss": load_rss}, "peaks": {"host_rss_peak": load_rss + GIB}}
        for p in phases
    }
    if "init" in ph:
        ph["init"]["weights_device"] = weights
    if gpu_peak is not None and "generate" in ph:
        ph["generate"]["peaks"]["nvml_device_used_peak"] = gpu_peak
    return {"rank": r, "status": status, "phases": ph, "error": error}


def test_aggregates_max_sum_and_per_rank():
    m = aggregate_metrics([rank(0, 2 * GIB, GIB), rank(1, 4 * GIB, 3 * GIB)])
    assert m["load.host_rss_gib.max"] == 4 and m["load.host_rss_gib.sum"] == 6 and m["load.host_rss_gib.rank0"] == 2
    assert m["init.weights_device_gib.max"] == 3 and m["load.wall_s.max"] == 2.0


def test_see_memory_usage_printout_becomes_rank0_metrics_next_to_ours():
    from dsexp.rank.probes.see_memory import parse

    r0, r1 = rank(0, 2 * GIB, GIB), rank(1, 4 * GIB, 3 * GIB)
    r0["phases"]["init"]["see_memory_usage"] = parse(
        "dsexp: after init\nMA 37.74 GB         Max_MA 37.76 GB         "
        "CA 37.96 GB         Max_CA 38 GB \n"
        "CPU Virtual Memory:  used = 5.27 GB, percent = 2.1%"
    )
    r1["phases"]["init"]["see_memory_usage"] = parse("")  # DeepSpeed prints on rank 0 only
    m = aggregate_metrics([r0, r1])
    assert m["init.see_memory_ma_gib.rank0"] == 37.74 and m["init.see_memory_cpu_used_gib.rank0"] == 5.27
    assert m["init.see_memory_max_ca_gib.max"] == 38 and "init.see_memory_ma_gib.rank1" not in m


def test_headline_takes_per_device_max():
    ranks = [rank(0, 2 * GIB, GIB, gpu_peak=5 * GIB), rank(1, 4 * GIB, 3 * GIB, gpu_peak=7 * GIB)]
    h = headline(aggregate_metrics(ranks), ranks, new_tokens=8)
    assert h["gpu_peak_gib"] == 7 and h["gpu_weights_gib"] == 3 and h["host_peak_gib"] == 5
    assert h["tokens_per_s"] == 8 / 2.0


def test_classify_ok_and_failures():
    ok = [rank(0, 1, 1), rank(1, 1, 1)]
    assert classify(False, 0, ok, {}) is None
    err = {"phase": "generate", "type": "OutOfMemoryError", "message": "CUDA out of memory", "time": 2.0}
    got = classify(False, 1, [rank(0, 1, 1), rank(1, 1, 1, status="failed", error=err)], {})
    assert (got["cause"], got["rank"], got["phase"]) == ("oom_gpu", 1, "generate")
    err = {
        "phase": "init",
        "type": "ValidationError",
        "message": "1 validation error for DeepSpeedInferenceConfig",
        "time": 1,
    }
    assert classify(False, 1, [rank(0, 1, 1, status="failed", error=err)], {})["cause"] == "config_rejected"
    # a user's script given a folder that is not there (2026-12-02): huggingface_hub's HFValidationError in the
    # traceback is no config rejected, the script raised
    err = {
        "phase": "start",
        "type": "OSError",
        "message": "Repo id must be in the form 'repo_name' or 'namespace/repo_name': '/tmp/nowhere/model'.",
        "traceback": "huggingface_hub.errors.HFValidationError: Repo id must be in the form 'repo_name'",
        "outside_calls": True,
        "time": 1,
    }
    assert classify(False, 1, [rank(0, 1, 1, status="failed", error=err)], {})["cause"] == "script_error"
    # a user's script whose argparse refused an argument (2026-12-03): sys.exit(2) says why only in what it printed
    err = {"phase": "start", "type": "SystemExit", "message": "the script exited with code 2", "outside_calls": True}
    refused = "main.py: error: argument --batch: invalid int value: 'four'"
    tails = {"rank0": f"usage: main.py [-h] --model MODEL\n{refused}\n"}
    got = classify(False, 1, [rank(0, 1, 1, status="failed", error=err)], tails)
    assert got["cause"] == "script_error" and got["message"] == (
        "SystemExit: the script exited with code 2; its last output: main.py: error: argument --batch: invalid int "
        "value: 'four'"
    )
    assert classify(False, 1, [rank(0, 1, 1, status="failed", error=err)], {})["message"].endswith("code 2")
    # a user's script with an option `--n` (2026-12-03): torchrun's argparse took it for one of its own, as plain
    # torchrun does; the message says whose argument it was
    ambiguous = "run.py: error: ambiguous option: --n could match --nnodes, --nproc-per-node, --node-rank"
    got = classify(False, 2, [None, None], {"launcher": f"usage: torchrun ...\n{ambiguous}\n"})
    assert got["cause"] == "launch_error" and got["message"].startswith(f"the launcher exited with rc=2: {ambiguous}")
    assert "read the script's argument --n as an abbreviation of its own options" in got["message"]
    assert "abbreviation" not in classify(False, 2, [None], {"launcher": "run.py: error: bad"})["message"]
    err = {"phase": "load", "type": "SafetensorError", "message": "incomplete metadata", "time": 1}
    assert classify(False, 1, [rank(0, 1, 1, status="failed", error=err)], {})["cause"] == "load_error"
    # rank 1 vanished during load (SIGKILL): no Python error anywhere
    dead = [
        rank(0, 1, 1, status="running", phases=("start", "load")),
        rank(1, 1, 1, status="running", phases=("start",)),
    ]
    got = classify(False, -9, dead, {"rank1": ""})
    assert (got["cause"], got["rank"], got["phase"]) == ("rank_crashed", 1, "load")
    assert classify(True, None, dead, {})["cause"] == "timeout"


def test_end_of_sweep_table_shows_failures_and_small_figures():
    from dsexp.compose.callbacks import format_table

    ok = {
        "job_dir": "/s/0",
        "status": "ok",
        "config": {"model": {"name": "tiny"}, "tp": 2},
        "headline": {"gpu_weights_gib": 0.00412, "host_peak_gib": 0.53},
        "correctness": {"logits_rel_err": 0.0071},
    }
    bad = {"job_dir": "/s/1", "status": "failed", "failure": {"cause": "oom_host"}, "config": {"tp": 4}}
    header, row0, row1 = format_table([ok, bad]).splitlines()
    assert row0.split()[:6] == ["0", "tiny/eager/tp2", "ok", "-", "0.00412", "0.53"] and row0.split()[-1] == "0.0071"
    assert row1.split()[:3] == ["1", "eager/tp4", "failed:oom_host"]


def test_typed_record_reads_the_result_and_tolerates_what_is_missing():
    from dsexp.analysis import measured
    from dsexp.core.result import JobRecord, Phase, PhaseRecord

    died = rank(1, 4 * GIB, 3 * GIB, status="failed", error={"phase": "init"}, phases=("start", "load"))
    result = {
        "status": "failed",
        "failure": {"cause": "oom_host", "rank": 1},
        "config": {"tp": 2, "device": "cpu"},
        "ranks": [rank(0, 2 * GIB, GIB, gpu_peak=5 * GIB), died, None],
        "headline": {"host_peak_gib": 5.0},
    }
    job = JobRecord.of(result)
    assert JobRecord.of(job) is job and job.tp == 2 and not job.ok and job.cause == "oom_host"
    assert not job.completed and not job.passed and not job.on_gpu and job.correctness == {}
    assert [rk.rank for rk in job.ranks] == [0, 1]  # a rank with no record is left out
    r0, r1 = job.ranks
    assert r0.phase(Phase.INIT).weights_device == GIB and r0.phase("init") == r0.phase(Phase.INIT)
    assert r0.phase(Phase.GENERATE).peak("nvml_device_used") == 5 * GIB and r0.max_over_phases("host_rss") == 3 * GIB
    assert r1.failed_in == "init" and r1.phase(Phase.INIT) is PhaseRecord.EMPTY and not r1.phase("init").recorded
    assert r1.phase(Phase.INIT).weights_device is None and r1.phase(Phase.INIT).host == {}
    assert PhaseRecord("generate_2", {"wall_s": 1.0}).kind == "generate" and not r0.phase("generate_2").recorded
    # measured's accessors take the dict or the typed view alike
    assert measured.weights_per_rank(result) == measured.weights_per_rank(job) == [GIB]
    assert measured.headline(job, "host_peak_gib") == 5.0 and not measured.init_recorded(job)
    assert JobRecord.of({}).ranks == () and JobRecord.of({}).tp == 1 and JobRecord.of(None).status is None
