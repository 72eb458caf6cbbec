"""On a GPU machine: a CUDA OOM and a SIGKILLed rank are classified, and every job leaves the devices'
memory (NVML) back at its pre-job baseline before the next job starts."""

from __future__ import annotations

import pytest

from helpers.run import run_dsexp, sweep_results


@pytest.mark.gpu
def test_gpu_faults_leave_device_memory_at_baseline(tmp_path, cache_dir):
    faults = "null,{rank:0,phase:init,kind:alloc_gpu,gib:100000},{rank:0,phase:generate,kind:sigkill}"
    run_dsexp(
        [
            "-m",
            "tp=1",
            "device=cuda",
            "check.correctness=false",
            "debug=fault",
            f"fault={faults}",
            "hydra.sweep.dir=multirun/g",
        ],
        tmp_path,
        cache_dir,
    )
    ok, oom, killed = sweep_results(tmp_path / "multirun" / "g")
    assert ok["status"] == "ok", ok.get("failure")
    assert (oom["failure"]["cause"], oom["failure"]["rank"], oom["failure"]["phase"]) == ("oom_gpu", 0, "init")
    assert (killed["failure"]["cause"], killed["failure"]["phase"]) == ("rank_crashed", "generate")
    assert killed["failure"]["memory_reached"]["rank0"]["nvml_device_used_gib"] > 0
    for res in (ok, oom, killed):
        td = res["teardown"]
        assert res["baseline"]["gpu_used"] == td["gpu_used_before"] and td["gpu_used_after"]
        assert td["gpu_back_to_baseline"] is True, td
        assert td["survivors"] == [] or td["left"] == []
