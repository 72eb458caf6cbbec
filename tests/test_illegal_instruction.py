"""A rank killed by SIGILL is named (issue 46): the failure says SIGILL, the crashing thread's innermost frame from
faulthandler's dump in the rank's log, the library or op it was in, the vector instruction sets the rank's CPU lacks
(/proc/cpuinfo; DSEXP_ASSUME_NO_AVX512=1 takes AVX-512 and AMX away, so this runs the same on any x86 CPU) and the
fix; the report's diagnosis says it whole."""

from __future__ import annotations

import json
import platform
from pathlib import Path

import pytest

from dsexp.core.cpu import features
from dsexp.job.illegal_instruction import crashing_frames, explain, few, sentence

from helpers.run import run_dsexp

SCRIPT = Path(__file__).parent / "data" / "user_scripts" / "illegal_instruction.py"
NO_AVX512 = {"arch": "x86_64", "has": ["avx", "avx2"], "lacks": ["avx512f", "avx512bw"], "assumed_no_avx512": False}
SHM_DUMP = """[2026-12-04] DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully
Fatal Python error: Illegal instruction

Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 331 in wait

Current thread 0x00007f0000000002 (most recent call first):
  File "/s/overlay/deepspeed/comm/torch.py", line 157 in inference_all_reduce
  File "/s/overlay/deepspeed/comm/comm.py", line 674 in inference_all_reduce
  File "/s/overlay/deepspeed/module_inject/layers.py", line 31 in forward
  File "/v/site-packages/torch/nn/modules/module.py", line 1541 in _call_impl

Extension modules: torch._C (total: 1)
"""


def test_deepspeeds_shared_memory_all_reduce_is_named_with_the_set_it_needs_and_the_fix():
    frames = crashing_frames(SHM_DUMP)
    assert [f["function"] for f in frames] == ["inference_all_reduce", "inference_all_reduce", "forward", "_call_impl"]
    info = explain(1, SHM_DUMP, NO_AVX512)
    assert info["frame"] == "torch.py:157 in inference_all_reduce" and info["library"] == "deepspeed"
    assert "shared-memory all-reduce" in info["op"] and info["needs"] == ["avx512bw"]
    assert "LOCAL_SIZE" in info["fix"]
    assert sentence(info).startswith(
        "rank 1 was killed by SIGILL (an illegal instruction) at torch.py:157 in inference_all_reduce (DeepSpeed's CPU"
    )
    assert sentence(info).endswith("; it needs avx512bw, which this CPU lacks")
    # no dump in the log (killed before faulthandler was on): SIGILL and the CPU still named, no frame
    bare = explain(0, "", NO_AVX512)
    assert bare["frame"] is None and sentence(bare) == (
        "rank 0 was killed by SIGILL (an illegal instruction); this CPU lacks avx512f, avx512bw"
    )


def test_the_setting_takes_avx512_away_and_cpuinfo_is_read(tmp_path, monkeypatch):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu sse4_2 avx avx2 avx512f avx512bw amx_tile\n\nprocessor\t: 1\n")
    monkeypatch.setattr(platform, "machine", lambda: "x86_64")
    monkeypatch.delenv("DSEXP_ASSUME_NO_AVX512", raising=False)
    assert features(str(info))["has"] == ["sse4_2", "avx", "avx2", "avx512f", "avx512bw", "amx_tile"]
    monkeypatch.setenv("DSEXP_ASSUME_NO_AVX512", "1")
    got = features(str(info))
    assert got["has"] == ["sse4_2", "avx", "avx2"] and {"avx512f", "avx512bw", "amx_tile"} <= set(got["lacks"])
    assert got["assumed_no_avx512"] and features(str(tmp_path / "none"))["has"] == []


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="ud2 / udf #0 are x86's and aarch64's")
def test_a_rank_that_executes_an_illegal_instruction_is_named(tmp_path, cache_dir):
    """The script's last rank calls into a page holding ud2 (0F 0B): a real SIGILL from the CPU."""
    run_dsexp([f"script.path={SCRIPT}", "tp=2", "check.correctness=false", "tracking.uri=none", "hydra.run.dir=one"],
              tmp_path, cache_dir, check=False, extra_env={"DSEXP_ASSUME_NO_AVX512": "1"})  # fmt: skip
    result = json.loads((tmp_path / "one" / "result.json").read_text())
    fail = result["failure"]
    assert (fail["cause"], fail["rank"], fail["type"]) == ("rank_crashed", 1, "signal"), fail
    info = fail["illegal_instruction"]
    assert info["frame"] == "illegal_instruction.py:17 in reduce_with_wide_vectors" and info["library"] == "the script"
    assert "avx512bw" in info["cpu_lacks"] and info["cpu_assumed_no_avx512"]
    # what the CPU lacks is this machine's own AVX-512 sets taken away (how many depends on the CPU it runs on)
    where = "at illegal_instruction.py:17 in reduce_with_wide_vectors (the script)"
    lacks = few(info["cpu_lacks"])
    assert fail["message"].startswith(
        f"rank 1 was killed by SIGILL (an illegal instruction) {where}; this CPU lacks {lacks}"
    )
    assert info["cpu_lacks"][0] == "avx512f"
    assert "Fix: the script's own code" in fail["message"]
    assert result["ranks"][1]["cpu"]["lacks"] == info["cpu_lacks"]  # the rank's own CPU, as it read it
    report = (tmp_path / "one" / "summary.md").read_text()
    assert f"on rank 1 in the start phase: {fail['message']}" in report
