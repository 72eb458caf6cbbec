"""The memory model's placement rules against real engines on CPU (tp=2, gloo): transformers TP, ZeRO-3 and
DeepSpeed AutoTP on an InternLM2-layout module with its injection policy. Each rank's measured census must match
the prediction within 2% (init_inference AutoTP on Llama is checked by the sweep in test_report_cpu.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dsexp.models.writer import ensure_checkpoint

from helpers.analysis_cases import TINY

WORKER = Path(__file__).parent / "helpers" / "engine_census_worker.py"


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["hf_tp", "zero3", "internlm2_policy"])
def test_placement_matches_the_engine(mode, tmp_path, cache_dir):
    model_dir = ensure_checkpoint(str(cache_dir), "tiny", "llama", TINY, "bf16").path
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "LOCAL_SIZE": "2", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(WORKER),
            mode,
            str(model_dir),
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for rank in (0, 1):
        rec = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert abs(rec["measured"] - rec["predicted"]) <= 0.02 * rec["predicted"], rec
    if mode == "internlm2_policy":
        assert rec["classes"]["LinearAllreduce"] == 4 and rec["classes"]["LinearLayer"] == 6
