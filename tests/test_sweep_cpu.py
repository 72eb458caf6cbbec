"""End to end on CPU: `python -m dsexp -m tp=1,2 load=eager model=tiny` -> two finished MLflow child runs."""

from __future__ import annotations

from pathlib import Path

import pytest

from dsexp.core.records import HEADLINE, PHASES

from helpers.run import sweep_results

UNQUANTIZED = [p for p in PHASES if p != "quantize"]  # the phases of a run without a quant member


@pytest.fixture(scope="module")
def sweep(tiny_sweep):
    return tiny_sweep


def test_every_rank_has_every_phase(sweep):
    _, sweep_dir, proc = sweep
    results = sweep_results(sweep_dir)
    assert [r["config"]["tp"] for r in results] == [1, 2]
    for res in results:
        assert res["status"] == "ok", res.get("failure")
        assert len(res["ranks"]) == res["config"]["tp"]
        for rk in res["ranks"]:
            assert list(rk["phases"]) == UNQUANTIZED
            for ph in rk["phases"].values():
                assert (
                    ph["wall_s"] > 0
                    and ph["host"]["host_rss"] > 0
                    and ph["peaks"]["host_rss_peak"] >= ph["host"]["host_rss"] * 0.5
                )
            assert rk["sampler"]["samples"] > 0
        assert res["correctness"]["passed"], res["correctness"]
    assert "tiny/eager/init_inference/bf16/tp2" in proc.stdout  # the end-of-sweep table


def test_tp2_shards_weights_and_records_tokens(sweep):
    _, sweep_dir, _ = sweep
    tp1, tp2 = sweep_results(sweep_dir)
    w1 = tp1["ranks"][0]["phases"]["init"]["weights_device"]
    w2 = [rk["phases"]["init"]["weights_device"] for rk in tp2["ranks"]]
    assert all(w < 0.75 * w1 for w in w2)
    assert tp2["engine"]["modules"]["added"].get("LinearAllreduce", 0) > 0
    for rk in tp2["ranks"]:
        assert len(rk["generate"]["tokens"]) == 16


def test_mlflow_has_parent_and_finished_children(sweep):
    import mlflow

    cwd, sweep_dir, _ = sweep
    mlflow.set_tracking_uri(f"sqlite:///{cwd / 'mlflow.db'}")
    runs = mlflow.search_runs(experiment_names=["dsexp"])
    parents = runs[runs["tags.dsexp.kind"] == "sweep"]
    children = runs[runs["tags.dsexp.kind"] == "job"]
    assert len(parents) == 1 and len(children) == 2
    assert set(children["tags.mlflow.parentRunId"]) == set(parents["run_id"])
    assert set(children["status"]) == {"FINISHED"} and parents["status"].iloc[0] == "FINISHED"
    assert set(children["tags.dsexp.status"]) == {"ok"}
    for name in HEADLINE:
        if name != "gpu_peak_gib":  # no GPU here
            assert children[f"metrics.{name}"].notna().all(), name
    tp2 = children[children["params.tp"] == "2"].iloc[0]
    for phase in UNQUANTIZED:
        for r in (0, 1):
            assert tp2[f"metrics.{phase}.host_rss_gib.rank{r}"] > 0
    client = mlflow.tracking.MlflowClient()
    arts = {a.path for a in client.list_artifacts(tp2["run_id"], "ranks")}
    assert {"ranks/rank0.json", "ranks/rank1.json", "ranks/rank0.log"} <= arts


def test_result_json_is_self_contained(sweep):
    _, sweep_dir, _ = sweep
    for res in sweep_results(sweep_dir):
        assert res["tracking"]["run_id"] and res["key"] and res["config"]["model"]["name"] == "tiny"
        assert Path(res["job_dir"], "job.json").is_file()


def test_cache_use_is_recorded_per_job_and_counted_at_the_end(sweep):
    _, sweep_dir, proc = sweep
    uses = [res["runtime"]["cache"] for res in sweep_results(sweep_dir)]
    assert all(
        u["checkpoint"] in ("hit", "miss") and u["reference"] in ("hit", "miss") and u["split"] == "none" for u in uses
    )
    assert uses[1] == {"checkpoint": "hit", "reference": "hit", "split": "none"}  # computed once, by job 0 at most
    hits = sum(u["reference"] == "hit" for u in uses)
    assert f"reference {hits} hit{'s' * (hits != 1)} / {2 - hits} computed" in proc.stdout


def test_job_and_rank_clocks_split_the_wall_time(sweep):
    from dsexp.analysis.overhead import SEGMENTS, breakdown

    _, sweep_dir, _ = sweep
    first, second = sweep_results(sweep_dir)
    c, launch, rk = second["clock"], second["launch"]["clock"], second["ranks"][1]
    # a process's creation time is the kernel's start tick against the time since boot, each to a 10 ms tick: it may
    # read up to two ticks before the launcher's Popen (psutil's, on a boot time in whole seconds, read 33 ms before)
    assert c["task"] <= c["started"] <= launch["popen"] <= rk["clock"]["created"] + 0.02
    assert rk["clock"]["created"] <= rk["clock"]["t0"]
    assert rk["clock"]["t0"] + rk["timeline"][-1]["t1"] <= rk["clock"]["finished"] <= launch["exited"]
    assert launch["exited"] <= launch["done"] <= c["ended"] <= c["tracked"]
    start = rk["phases"]["start"]
    assert 0 < start["imports_s"] < start["wall_s"] and start["rendezvous_s"] > 0
    assert "wait_s" in rk["phases"]["init"]  # tp=2: each phase starts on both ranks together
    b = breakdown(second, previous=first)
    parts = [b[name] for name, *_ in SEGMENTS] + [b["hydra"]]
    assert all(p > -0.05 for p in parts), b  # consecutive marks: no segment runs backwards
    assert sum(parts) == pytest.approx(b["total"]) and b["total"] == pytest.approx(
        c["tracked"] - first["clock"]["tracked"]
    )
    # the ranks' own work is the last rank's (the one whose generate ended last): load + init + generate
    last = max(second["ranks"], key=lambda r: r["clock"]["t0"] + r["timeline"][-1]["t1"])
    assert b["rank_work"] == pytest.approx(sum(last["phases"][p]["wall_s"] for p in ("load", "init", "generate")))


def test_a_process_start_is_read_on_the_wall_clock_to_a_tick():
    """The rank's `created` clock: a child started now reads within two 10 ms ticks of the time it was started,
    on time.time()'s clock (psutil's create_time rests on a boot time in whole seconds: up to a second early)."""
    import subprocess
    import sys
    import time

    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "from dsexp.rank.probes.host import process_started; print(process_started())"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    started = float(out.stdout.strip())
    assert before - 0.02 <= started <= time.time()
