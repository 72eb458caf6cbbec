"""launcher.pack=true: the sweep's GPU allocator (disjoint claims, waiting, overlap records, dead claims), the
settings it refuses, how packed results are shown, the packed-vs-sequential comparison; a packed CPU sweep end
to end against the sequential one (slow)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest

from dsexp.analysis import measured
from dsexp.analysis import packed as packed_cmp
from dsexp.compose.callbacks import format_table
from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate
from dsexp.core import records
from dsexp.core.schema import ConfigError
from dsexp.job.cluster import packing

from helpers.run import CONF, compose, run_dsexp, sweep_results


@pytest.fixture
def sweep(tmp_path, monkeypatch):
    monkeypatch.setenv(packing.FAKE_ENV, "2")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert packing.init_pool(tmp_path) == ["0", "1"]
    return tmp_path


def test_pool_comes_from_fake_gpus_then_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv(packing.FAKE_ENV, "4")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert packing.gpu_pool() == ["0", "1", "2", "3"]
    monkeypatch.delenv(packing.FAKE_ENV)
    assert packing.gpu_pool() == ["2", "3"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert packing.gpu_pool() == []


def test_claims_are_disjoint_set_cuda_visible_devices_and_a_full_pool_makes_jobs_wait(sweep):
    cpus = os.sched_getaffinity(0)
    with packing.claim(sweep, sweep / "0", 1) as a:
        assert os.environ["CUDA_VISIBLE_DEVICES"] == a["gpus"] and os.sched_getaffinity(0) == set(a["cpus"])
        with packing.claim(sweep, sweep / "1", 1) as b:
            assert {a["gpus"], b["gpus"]} == {"0", "1"}
            assert packing._try_claim(sweep, "2", 1) is None  # nothing free: job 2 waits
        assert os.environ["CUDA_VISIBLE_DEVICES"] == a["gpus"]  # restored when job 1 let go
        assert packing._try_claim(sweep, "2", 1)["gpus"] == [b["gpus"]]
    assert "CUDA_VISIBLE_DEVICES" not in os.environ and os.sched_getaffinity(0) == cpus


def test_each_gpu_brings_its_slice_of_the_cpus():
    cpus = list(range(16))
    assert packing.cpu_share(cpus, ["0", "1"], ["1"]) == list(range(8, 16))
    assert packing.cpu_share(cpus, ["0", "1", "2", "3"], ["0", "2"]) == [0, 1, 2, 3, 8, 9, 10, 11]
    assert packing.cpu_share([0, 1], ["0", "1", "2", "3"], ["0"]) == [0]  # fewer CPUs than GPUs: one each, shared


def test_a_waiting_job_gets_the_gpus_as_soon_as_they_are_released(sweep):
    got = {}

    def job2():
        with packing.claim(sweep, sweep / "2", 2, poll_s=0.05) as c:
            got.update(c)

    with packing.claim(sweep, sweep / "0", 1):
        waiter = threading.Thread(target=job2)
        waiter.start()
        time.sleep(0.4)
        assert not got  # needs both GPUs, one is held
    waiter.join(timeout=10)
    assert got["gpus"] == "0,1" and got["waited_s"] >= 0.3


def test_release_names_the_jobs_that_ran_meanwhile(sweep):
    with packing.claim(sweep, sweep / "0", 1) as a:
        with packing.claim(sweep, sweep / "1", 1) as b:
            pass
    with packing.claim(sweep, sweep / "2", 2) as c:  # alone: both others are done
        pass
    assert b["overlapped_with"] == ["0"] and a["overlapped_with"] == ["1"] and c["overlapped_with"] == []
    assert records.node_shared({"packed": a}) and not records.node_shared({"packed": c})


def test_a_claim_whose_process_is_gone_is_dropped(sweep):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    with packing._state(sweep) as state:
        state["claims"]["dead"] = {
            "gpus": ["0", "1"],
            "pid": gone.pid,
            "host": os.uname().nodename,
            "since": time.time(),
        }
    assert packing._try_claim(sweep, "3", 2)["gpus"] == ["0", "1"]


def test_more_gpus_than_the_pool_is_an_error_not_a_wait(sweep):
    with pytest.raises(RuntimeError, match="needs 3 GPUs but the sweep's pool has 2"):
        packing._try_claim(sweep, "0", 3)


def test_without_gpus_jobs_never_wait_and_are_still_marked_overlapping(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    packing.init_pool(tmp_path)
    with packing.claim(tmp_path, tmp_path / "0", 2) as a, packing.claim(tmp_path, tmp_path / "1", 2) as b:
        assert a["gpus"] is None and b["gpus"] is None
    assert a["overlapped_with"] == ["1"]


def test_packing_is_refused_across_nodes_and_under_slurm():
    from hydra import compose as hcompose
    from hydra import initialize_config_dir

    from dsexp.compose.sweep import validate_sweep

    with pytest.raises(ConfigError, match="launcher.pack=true"):
        validate(to_schema(compose(["launcher.pack=true", "launcher.nodes=2", "tp=2"])), gpus=0)
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        errors = validate_sweep(
            hcompose("config", overrides=["hydra/launcher=dsexp_slurm", "launcher.pack=true"], return_hydra_config=True)
        )
    assert len(errors) == 1 and "with a SLURM launcher" in errors[0][1]


def test_shared_node_figures_are_left_out_of_the_analysis_and_marked_in_the_table():
    res = {
        "job_dir": "/s/0",
        "status": "ok",
        "config": {"tp": 1, "model": {"name": "tiny"}},
        "headline": {"node_host_peak_gib": 3.5, "host_peak_gib": 1.0},
        "baseline": {"node_used": 2**30},
        "packed": {"gpus": "0", "overlapped_with": ["1"]},
    }
    assert measured.headline(res, "node_host_peak_gib") is None and measured.node_growth(res) is None
    assert measured.headline(res, "host_peak_gib") == 1.0
    row = format_table([res]).splitlines()[1].split()
    assert row[5:7] == ["1.00", "shared"]
    alone = {**res, "packed": {"gpus": "0", "overlapped_with": []}}
    assert measured.headline(alone, "node_host_peak_gib") == 3.5


def _job(variant, rss, weights=1000, pack=False, gpus=None, overlapped=(), alloc=None, t=(0.0, 10.0), idx=0):
    """A result of one tp=2 job: both ranks with these peaks (alloc: a GPU figure, absent on CPU)."""

    def rank(r):
        phase = {
            "wall_s": 1.0,
            "peaks": {"host_rss_peak": rss + r},
            "gpu": {} if alloc is None else {"gpu_alloc_peak": alloc},
        }
        return {
            "rank": r,
            "phases": {
                "start": phase,
                "load": {**phase, "weights_device": 0},
                "init": {**phase, "weights_device": weights},
                "generate": phase,
            },
        }

    res = {
        "job_dir": f"/s/{idx}",
        "status": "ok",
        "ranks": [rank(0), rank(1)],
        "config": {"variant": variant, "tp": 2, "launcher": {"name": "torchrun", "pack": pack}},
        "clock": {"task": t[0], "tracked": t[1]},
    }
    if pack:
        res["packed"] = {"gpus": gpus, "cpus": [0], "waited_s": 0.0, "overlapped_with": list(overlapped)}
    return res


def test_comparison_pairs_jobs_by_config_and_finds_the_largest_difference():
    seq = [_job("a", 1000, t=(0, 10)), _job("b", 2000, alloc=500, t=(10, 20))]
    packed = [
        _job("b", 2010, pack=True, gpus="0,1", alloc=500, t=(0, 11), overlapped=["1"], idx=0),  # order differs
        _job("a", 1030, pack=True, gpus="2,3", t=(1, 10), overlapped=["0"], idx=1),
    ]
    data = packed_cmp.compare(seq, packed)
    rss = data["figures"]["host_rss_peak"]
    assert rss["where"] == "a rank 0" and rss["max_rel_diff"] == pytest.approx(0.03) and not rss["within_tolerance"]
    assert data["figures"]["weights_device"]["max_rel_diff"] == 0
    assert data["figures"]["gpu_alloc_peak"]["within_tolerance"]
    assert "gpu_peak_nvml" not in data["figures"]  # recorded by neither run: not compared
    assert not data["all_within_tolerance"] and data["ratio"] == pytest.approx(11 / 20)
    assert data["placement"]["b"] == {"gpus": "0,1", "cpus": 1, "waited_s": 0.0, "overlapped_with": ["a"]}
    text = packed_cmp.render(data)
    assert "| host_rss_peak | 3.000% | a rank 0 |" in text and "| NO |" in text and "0.55" in text


def test_comparison_refuses_sweeps_of_different_jobs():
    with pytest.raises(ValueError, match="no counterpart"):
        packed_cmp.compare([_job("a", 1000)], [_job("c", 1000, pack=True, gpus="0,1")])
    with pytest.raises(ValueError, match="without a sequential counterpart"):
        packed_cmp.compare(
            [_job("a", 1000)], [_job("a", 1000, pack=True, gpus="0,1"), _job("b", 1000, pack=True, gpus="2,3")]
        )


@pytest.mark.slow
def test_packed_cpu_sweep_gives_disjoint_gpus_and_the_sequential_figures(tmp_path, cache_dir):
    """3 tp=1 jobs on 2 fake GPUs through the submitit launcher, against the same jobs run one by one."""
    jobs = ["-m", "model=tiny", "tp=1", "variant=a,b,c"]
    run_dsexp([*jobs, "hydra.sweep.dir=multirun/seq"], tmp_path, cache_dir)
    proc = run_dsexp(
        [*jobs, "hydra/launcher=dsexp_local", "launcher.pack=true", "hydra.sweep.dir=multirun/pack"],
        tmp_path,
        cache_dir,
        extra_env={packing.FAKE_ENV: "2"},
    )
    seq, packed = sweep_results(tmp_path / "multirun" / "seq"), sweep_results(tmp_path / "multirun" / "pack")
    assert [r["status"] for r in packed] == ["ok"] * 3, [r.get("failure") for r in packed]
    spans = {r["job_dir"].rsplit("/", 1)[1]: r["packed"] for r in packed}
    for name, p in spans.items():
        for other in p["overlapped_with"]:
            assert p["gpus"] != spans[other]["gpus"]  # jobs that ran at once had different GPUs
            assert p["since"] < spans[other]["until"] and spans[other]["since"] < p["until"]
    assert any(p["overlapped_with"] for p in spans.values()) and "shared" in proc.stdout
    masters = [r["ranks"][0]["master"] for r in packed]
    assert len(set(masters)) == 3  # each job's own rendezvous port
    for s, p in zip(seq, packed):
        assert s["config"]["variant"] == p["config"]["variant"]
        assert "packed" not in s and len(p["packed"]["cpus"]) == 1  # its GPU's half of the 2 CPUs
        assert s["ranks"][0]["generate"]["tokens"] == p["ranks"][0]["generate"]["tokens"]
        assert p["tracking"]["run_id"]  # every job logged despite the concurrent sqlite writers
    cmp = packed_cmp.compare(seq, packed)
    assert cmp["jobs"] == 3 and set(cmp["figures"]) == {"weights_device", "host_rss_peak", "host_anon_peak"}
    assert cmp["figures"]["weights_device"]["max_rel_diff"] == 0
    assert cmp["all_within_tolerance"], cmp["figures"]
