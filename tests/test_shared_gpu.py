"""Ranks sharing a GPU (launcher.gpus): the decisions, tested without a GPU (the backend, the device each rank maps to,
the labels, the fit check and its refusal, speed left out of comparisons); a GPU-marked test runs tp=2 on one GPU."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest

from dsexp.analysis import measured as m
from dsexp.analysis.labels import config_label
from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate
from dsexp.core.protocol import SHARED_GPUS_ENV
from dsexp.core.records import headline
from dsexp.core.schema import ConfigError
from dsexp.job.launch import rank_env
from dsexp.rank.shared_gpu import LOCAL_RANK_ENV, map_rank

from helpers.run import compose, run_dsexp, sweep_results

GIB = 2**30
H200 = 143 * GIB


def spec_of(*overrides, gpus=1, gpu_total=H200):
    return validate(to_schema(compose(["device=cuda", *overrides])), gpus=gpus, gpu_total=gpu_total)


@pytest.mark.parametrize("local, pool, gpu", [(0, "0", "0"), (3, "0", "0"), (1, "2,3", "3"), (2, "2,3", "2")])
def test_each_rank_sees_only_its_shared_gpu_as_local_rank_0(local, pool, gpu):
    env = {SHARED_GPUS_ENV: pool, "LOCAL_RANK": str(local)}
    argv = ["main.py", f"--local_rank={local}", "--ds_inference"]
    done = map_rank(env, argv)
    assert env["CUDA_VISIBLE_DEVICES"] == gpu and env["LOCAL_RANK"] == "0" and env[LOCAL_RANK_ENV] == str(local)
    assert argv == ["main.py", "--local_rank=0", "--ds_inference"]
    assert done == {"gpu": gpu, "local_rank": local, "shared_by": pool.split(","), "backend": "gloo"}
    assert map_rank(env, argv)["local_rank"] == local  # idempotent: the real local rank is kept


def test_a_job_with_a_gpu_per_rank_maps_nothing():
    env = {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1"}
    assert map_rank(env, None) is None and env == {"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,1"}


GROUPS = textwrap.dedent(
    """
    import os, sys, tempfile
    import torch.distributed as dist
    if sys.argv[1] == "forced":
        from dsexp.rank.shared_gpu import force_gloo
        force_gloo()
    store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
    dist.init_process_group(backend="nccl", store=store, rank=0, world_size=1)
    sub = dist.new_group([0], backend="nccl")
    print("backends", dist.get_backend(), dist.get_backend(sub))
    """
)


def test_every_process_group_is_gloo_whatever_backend_is_asked():
    """Asked for NCCL (as DeepSpeed and transformers ask on a GPU), the default group and a new group are gloo.
    The same code without force_gloo fails on this CPU build of torch: the test can tell the two apart."""
    run = lambda mode: subprocess.run(  # noqa: E731
        [sys.executable, "-c", GROUPS, mode], capture_output=True, text=True, timeout=120, env={**os.environ}
    )
    forced = run("forced")
    assert forced.returncode == 0, forced.stderr[-2000:]
    assert "backends gloo gloo" in forced.stdout
    plain = run("plain")
    assert plain.returncode != 0 and "nccl" in plain.stderr.lower()


def test_the_ranks_get_the_shared_gpus_and_the_job_says_so():
    spec = spec_of("tp=4", "launcher.gpus=1")
    assert spec.shared_gpu and spec.ranks_per_node == 4
    assert rank_env(spec, "cuda")[SHARED_GPUS_ENV] == "0"
    assert rank_env(spec, "cuda", visible="2,3")[SHARED_GPUS_ENV] == "2"
    two = spec_of("tp=4", "launcher.gpus=2", gpus=2)
    assert rank_env(two, "cuda", visible="5,7")[SHARED_GPUS_ENV] == "5,7"
    assert SHARED_GPUS_ENV not in rank_env(spec_of("tp=1", "launcher.gpus=1"), "cuda")  # one rank: nothing shared
    assert not spec_of("tp=1", "launcher.gpus=1").shared_gpu


@pytest.mark.parametrize(
    "overrides, gpus, words",
    [
        (["tp=2"], 1, ["tp=2 needs 2 GPUs", "launcher.gpus=1"]),
        (["tp=2", "launcher.gpus=2"], 1, ["launcher.gpus=2 but only 1 GPUs are visible"]),
        (["tp=2", "launcher.gpus=0"], 1, ["launcher.gpus=0: must be >= 1"]),
        (["tp=2", "launcher.gpus=1", "launcher.pack=true"], 1, ["launcher.pack=true", "launcher.gpus"]),
    ],
)
def test_bad_gpu_sharing_is_refused_before_launch(overrides, gpus, words):
    with pytest.raises(ConfigError) as e:
        spec_of(*overrides, gpus=gpus)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_gpu_sharing_on_cpu_is_refused():
    with pytest.raises(ConfigError, match="launcher.gpus=1 shares GPUs between ranks, but device=cpu"):
        validate(to_schema(compose(["device=cpu", "tp=2", "launcher.gpus=1"])), gpus=0)


def test_a_job_that_cannot_fit_the_shared_gpu_is_refused_naming_both_figures():
    """internlm2_20b_shapes: 37.7 GiB of bf16 weights; 4 ranks of the seed's kernel injection (nothing sharded on
    InternLM2) each hold all of it: ~151 GiB + 4 contexts > an H200's 143 GiB. AutoTP at tp=4 fits."""
    seed = ["model=internlm2_20b_shapes", "tp=4", "launcher.gpus=1", "engine.kernel_inject=true"]
    with pytest.raises(ConfigError) as e:
        spec_of(*seed)
    msg = str(e.value)
    assert "4 ranks share one GPU" in msg and "143.0 GiB" in msg
    need = float(msg.split("predicted to hold ")[1].split(" GiB")[0])
    assert 150 < need < 160
    assert spec_of("model=internlm2_20b_shapes", "tp=4", "launcher.gpus=1", "experiment=autotp").shared_gpu
    assert spec_of(*seed, gpu_total=200 * GIB).shared_gpu  # the same job on a larger GPU is let through


def test_the_label_marks_shared_gpu_runs_at_every_tp():
    """tp=1 and tp=2 on the shared launcher are one configuration (one row per tp in the tp table); never the same
    row as a GPU per rank."""
    label = lambda *o, gpus=1: config_label(dataclasses.asdict(spec_of(*o, gpus=gpus)))  # noqa: E731
    assert label("tp=2", "launcher.gpus=1").endswith("/shared_gpu")
    assert label("tp=1", "launcher.gpus=1") == label("tp=2", "launcher.gpus=1")
    assert label("tp=1", "launcher.gpus=1") != label("tp=1")
    assert "shared_2gpu" in label("tp=4", "launcher.gpus=2", gpus=2)


def _rank(r, proc_peak, device_peak):
    gpu = {"nvml_process_used_peak": proc_peak, "nvml_device_used_peak": device_peak}
    return {"rank": r, "hostname": "h", "phases": {"generate": {"wall_s": 2.0, "peaks": gpu}}}


def test_a_shared_run_takes_each_ranks_own_gpu_peak_and_keeps_the_devices_as_a_node_figure():
    from dsexp.core.records import aggregate_metrics

    ranks = [_rank(0, 20 * GIB, 41 * GIB), _rank(1, 21 * GIB, 41 * GIB)]
    metrics = aggregate_metrics(ranks)
    shared = headline(metrics, ranks, 16, shared_gpu=True)
    assert shared["gpu_peak_gib"] == 21 and shared["node_gpu_peak_gib"] == 41
    assert headline(metrics, ranks, 16)["gpu_peak_gib"] == 41  # a GPU per rank: the device's figure


def test_speed_of_a_shared_run_is_shown_marked_and_never_compared():
    from dsexp.analysis.matrix import build_rows
    from dsexp.analysis.sections.matrix_table import matrix_table

    def result(shared):
        spec = spec_of("tp=2", "launcher.gpus=1") if shared else spec_of("tp=2", gpus=2)
        return {
            "config": dataclasses.asdict(spec),
            "status": "ok",
            "runtime": {"device": "cuda", **({"shared_gpu": True} if shared else {})},
            "headline": {"tokens_per_s": 3.5, "generate_s": 4.57, "gpu_weights_gib": 1.0},
            "ranks": [],
        }

    shared, own = result(True), result(False)
    assert m.headline(shared, "tokens_per_s") is None and m.raw_headline(shared, "tokens_per_s") == 3.5
    assert m.headline(own, "tokens_per_s") == 3.5
    table = matrix_table(build_rows([shared, own]))
    assert "(3.5)" in table and "(4.57)" in table and "not measured (shared GPU)" in table
    assert table.count("(3.5)") == 1  # the run with a GPU per rank shows its speed plainly


@pytest.mark.gpu
def test_tp2_shares_one_gpu(tmp_path, cache_dir):
    """On a GPU machine: two ranks on one GPU run AutoTP over gloo, each holding its own half of the weights."""
    run_dsexp(
        ["-m", "tp=2", "launcher.gpus=1", "experiment=autotp", "model=internlm2_tiny", "hydra.sweep.dir=s"],
        tmp_path,
        cache_dir,
    )
    (res,) = sweep_results(tmp_path / "s")
    assert res["status"] == "ok" and res["runtime"]["shared_gpu"], res.get("failure")
    assert [rk["shared_gpu"]["local_rank"] for rk in res["ranks"]] == [0, 1]
    assert {rk["shared_gpu"]["gpu"] for rk in res["ranks"]} == {"0"}
    assert all(rk["phases"]["generate"]["gpu"]["nvml_process_used"] for rk in res["ranks"])


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["experiment=hf_tp"], ["engine=hf_tp", "SIGSEGV in generate"]),
        (["model=tiny", "engine.kernel_inject=true"], ["kernel_inject", "LlamaDecoderLayer", "AutoTP"]),
    ],
)
def test_engines_that_did_not_run_shared_are_refused_with_the_reason(overrides, words):
    with pytest.raises(ConfigError) as e:
        spec_of("tp=2", "launcher.gpus=1", *overrides)
    assert all(w in str(e.value) for w in words), str(e.value)
    assert spec_of("tp=1", "launcher.gpus=1", *overrides)  # one rank shares nothing: it runs


def test_the_seeds_kernel_injection_runs_shared_since_internlm2_has_no_kernel_policy():
    assert spec_of("tp=2", "launcher.gpus=1", "experiment=seed_issue_accepted").shared_gpu
