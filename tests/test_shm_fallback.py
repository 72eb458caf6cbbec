"""DeepSpeed's CPU shared-memory all-reduce on a CPU without avx512bw (issue 46, dsexp.rank.shm_fallback): its
reduce kernels are built for avx512bw, so there they die of SIGILL. DeepSpeed 0.14.4 (stack=seed) uses them only
where LOCAL_SIZE is the world size, else gloo's all_reduce: the ranks set LOCAL_SIZE=1 on such a CPU (or under
DSEXP_ASSUME_NO_AVX512=1, so that this runs on any CPU), record it, and the report says it in one line."""

from __future__ import annotations

import json
import os

import pytest

from dsexp.analysis.diagnosis import all_reduce
from dsexp.rank import shm_fallback
from dsexp.rank.shm_fallback import avoid_shm_allreduce, deepspeed_source, kind

from helpers.run import run_dsexp

NO_AVX512 = {"arch": "x86_64", "has": ["avx2"], "lacks": ["avx512f", "avx512bw"], "assumed_no_avx512": True}
# deepspeed/comm/torch.py's inference_all_reduce as 0.14.4 and 0.14.5 wrote it (the lines kind() reads)
DS_0144 = """def build_shm_op(): ...
    def inference_all_reduce(self, tensor, op, group=None):
        if self.shm_comm_op == None or self.shm_comm_op.inference_all_reduce(tensor, op) == -1:
"""
DS_0145 = """def build_shm_op(): ...
        else:
            return torch.ops.deepspeed.inference_all_reduce_(tensor)
"""


def test_each_deepspeed_is_told_apart_by_its_source():
    assert kind(deepspeed_source().read_text()) == "guarded"  # the job environment's 0.19.8 checks the CPU itself
    assert (kind(DS_0144), kind(DS_0145), kind("import torch\n")) == ("local_size", "none", None)


def test_the_seed_deepspeed_is_switched_to_gloo_and_others_are_left_alone(tmp_path, monkeypatch):
    source = tmp_path / "torch.py"
    source.write_text(DS_0144)
    monkeypatch.setattr(shm_fallback, "deepspeed_source", lambda: source)
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    got = avoid_shm_allreduce(NO_AVX512)
    assert got["all_reduce"] == "gloo" and got["local_size"] == {"was": "2", "now": "1"}
    assert got["why"] == (
        "the CPU lacks avx512bw (DSEXP_ASSUME_NO_AVX512=1), which DeepSpeed's shared-memory all-reduce kernels are "
        "built for"
    )
    assert os.environ["LOCAL_SIZE"] == "1"
    (line,) = all_reduce({"all_reduce": got})
    assert line.text.startswith("all-reduce on gloo, not DeepSpeed ")
    assert line.text.endswith("(LOCAL_SIZE=1 in the ranks, was 2)")
    monkeypatch.setenv("LOCAL_SIZE", "2")
    assert avoid_shm_allreduce({**NO_AVX512, "has": ["avx2", "avx512bw"], "lacks": ["amx_tile"]}) is None
    assert os.environ["LOCAL_SIZE"] == "2"  # a CPU with avx512bw: DeepSpeed's shared memory as it is
    source.write_text(DS_0145)
    assert "expect SIGILL" in avoid_shm_allreduce(NO_AVX512)["all_reduce"] and os.environ["LOCAL_SIZE"] == "2"
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    assert avoid_shm_allreduce(NO_AVX512) is None and all_reduce({}) == []


@pytest.mark.slow  # the seed stack (prepared once: 26 s) and its shared-memory op JIT-built once (about 90 s)
def test_the_seed_stack_runs_its_all_reduce_on_gloo_on_a_cpu_without_avx512(tmp_path, cache_dir):
    """stack=seed, tp=2, under both launchers (the DeepSpeed launcher sets LOCAL_SIZE itself: the rank sets it after):
    correct against tp=1, and no shared-memory segment was ever made (DeepSpeed makes one per rank when it uses it)."""
    run_dsexp(["-m", "stack=seed", "model=tiny", "tp=2", "launcher=torchrun,deepspeed", "tracking.uri=none",
               "hydra.sweep.dir=s"], tmp_path, cache_dir, timeout=1800,
              extra_env={"DSEXP_ASSUME_NO_AVX512": "1"})  # fmt: skip
    results = [json.loads(p.read_text()) for p in sorted((tmp_path / "s").glob("*/result.json"))]
    assert len(results) == 2
    for res in results:
        assert res["status"] == "ok" and res["correctness"]["passed"], res.get("failure")
        assert res["software"]["versions"]["deepspeed"] == "0.14.4"
        assert res["all_reduce"]["all_reduce"] == "gloo" and res["all_reduce"]["kind"] == "local_size"
        assert all(rk["all_reduce"] == res["all_reduce"] for rk in res["ranks"])
        assert res["teardown"]["shm_removed"] == []  # no deepspeed_allreduce_buffer_* segment
    report = (tmp_path / "s" / "summary.md").read_text()
    assert report.count("- all-reduce on gloo, not DeepSpeed 0.14.4's shared memory: the CPU lacks avx512bw") == 2


@pytest.mark.slow  # two seed-stack jobs of two ranks: about 2 min here once the stack and its op are built
@pytest.mark.skipif("avx512bw" not in (open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""),
                    reason="the comparison needs a CPU whose shared-memory all-reduce runs")  # fmt: skip
def test_the_fallback_leaves_the_measured_memory_as_the_shared_memory_path_has_it(tmp_path, cache_dir):
    """On a CPU that has avx512bw, stack=seed at tp=2 with DeepSpeed's shared-memory all-reduce and with the gloo
    fallback (DSEXP_ASSUME_NO_AVX512=1): the same weights on every rank, the same output within bf16's tolerance, and
    host peaks per rank within the shared-memory op's own buffers of each other."""
    runs = {}
    for name, env in (("shm", {}), ("gloo", {"DSEXP_ASSUME_NO_AVX512": "1"})):
        run_dsexp(["stack=seed", "model=tiny", "tp=2", "tracking.uri=none", f"hydra.run.dir={name}"], tmp_path,
                  cache_dir, timeout=1800, extra_env=env)  # fmt: skip
        runs[name] = json.loads((tmp_path / name / "result.json").read_text())
    shm, gloo = runs["shm"], runs["gloo"]
    assert shm["status"] == gloo["status"] == "ok", (shm.get("failure"), gloo.get("failure"))
    assert gloo["all_reduce"]["all_reduce"] == "gloo" and (shm.get("all_reduce") or {}).get("all_reduce") != "gloo"
    for a, b in zip(shm["ranks"], gloo["ranks"]):
        assert a["phases"]["init"]["weights_device"] == b["phases"]["init"]["weights_device"]
        peaks = [max(ph.get("peaks", {}).get("host_anon_peak") or 0 for ph in r["phases"].values()) for r in (a, b)]
        # the op's workspace per rank (csrc/cpu/comm/shm.cpp, 0.14.4): 2 x 32 MiB + 2 x 1 MiB, and its shared segments
        print(f"rank {a['rank']}: weights {a['phases']['init']['weights_device']} B both; host anon peak shm "
              f"{peaks[0] / 2**20:.1f} MiB, gloo {peaks[1] / 2**20:.1f} MiB")  # fmt: skip
        assert abs(peaks[0] - peaks[1]) < 96 * 2**20, peaks
    assert shm["correctness"]["passed"] and gloo["correctness"]["passed"]
