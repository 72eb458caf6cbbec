"""DeepSpeed's CPU shared-memory all-reduce on a CPU without avx512bw: gloo's all_reduce instead, where DeepSpeed
has a switch for it.

On DeepSpeed's CPU accelerator, deepspeed.comm's TorchBackend JIT-builds deepspeed_shm_comm (csrc/cpu/comm/shm.cpp,
shm_interface.cpp) and inference_all_reduce (AutoTP's LinearAllreduce and LmHeadLinearAllreduce,
module_inject/layers.py) calls it. Its reduce kernels are compiled with `target("avx512bw")` in every release, so
on a CPU without avx512bw they die of SIGILL. What each DeepSpeed does about it (read from its source here, without
importing it, as the rank will import it: a stack's overlay first):

- `guarded` (the installed 0.19.8; not in 0.19.5): it asks the CPU (vector_kernel_level) and calls
  torch.distributed.all_reduce where the kernels cannot run. Nothing to do; it asks the real CPU, so
  DSEXP_ASSUME_NO_AVX512 does not reach it.
- `local_size` (0.14.4 and before, the seed's): initialize() turns the shared memory on only where LOCAL_SIZE is the
  world size; otherwise inference_all_reduce returns -1 and deepspeed/comm/torch.py calls
  torch.distributed.all_reduce (gloo). The switch: LOCAL_SIZE=1 in the rank before deepspeed.init_distributed (the
  DeepSpeed launcher's launch.py sets LOCAL_SIZE itself, so the rank sets it, not the job). LOCAL_SIZE is read
  elsewhere only by the CPU accelerator's device_count (1 here: one device per process, as on a GPU).
- `none` (0.14.5 to 0.19.5): the op is called whenever it was built, and a LOCAL_SIZE short of the world size
  leaves its shared memory unset (SIGSEGV): no switch; the record says a SIGILL is to be expected.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any, Dict, Optional

from dsexp.core.compat import installed
from dsexp.core.cpu import ASSUME_NO_AVX512_ENV, features

NEEDS = "avx512bw"


def deepspeed_source() -> Optional[Path]:
    """deepspeed/comm/torch.py of the DeepSpeed this process would import (None: none, or no such file)."""
    try:
        spec = importlib.util.find_spec("deepspeed")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = Path(spec.origin).parent / "comm" / "torch.py"
    return path if path.is_file() else None


def kind(source: str) -> Optional[str]:
    """guarded / local_size / none (module docstring); None where it has no shared-memory all-reduce."""
    if "build_shm_op" not in source:
        return None
    if "vector_kernel_level" in source:
        return "guarded"
    if ".inference_all_reduce(tensor, op) == -1" in source:
        return "local_size"
    return "none"


def avoid_shm_allreduce(cpu: Optional[Dict[str, Any]] = None) -> Optional[Dict[str, Any]]:
    """On DeepSpeed's CPU accelerator, with a CPU that lacks avx512bw (or DSEXP_ASSUME_NO_AVX512=1): switch the
    shared-memory all-reduce off where DeepSpeed can (LOCAL_SIZE=1, set here) and say what was done and why; None
    where there is nothing to say (a GPU run, a CPU with avx512bw, a DeepSpeed without the op)."""
    if os.environ.get("DS_ACCELERATOR") != "cpu":
        return None
    cpu = cpu or features()
    if not cpu.get("lacks") or NEEDS in (cpu.get("has") or []):
        return None
    path = deepspeed_source()
    how = kind(path.read_text(errors="replace")) if path else None
    if how is None:
        return None
    assumed = f" ({ASSUME_NO_AVX512_ENV}=1)" if cpu.get("assumed_no_avx512") else ""
    out: Dict[str, Any] = {
        "deepspeed": installed("deepspeed"),  # the first on sys.path: a stack's overlay before the job's
        "kind": how,
        "why": f"the CPU lacks {NEEDS}{assumed}, which DeepSpeed's shared-memory all-reduce kernels are built for",
    }
    if how == "local_size":
        was = os.environ.get("LOCAL_SIZE")
        os.environ["LOCAL_SIZE"] = "1"  # before deepspeed.init_distributed: shm_interface.cpp reads it there
        return {**out, "all_reduce": "gloo", "local_size": {"was": was, "now": "1"}}
    if how == "guarded":
        return {**out, "all_reduce": "DeepSpeed's own check of the CPU (shared memory where it has avx512bw)"}
    return {**out, "all_reduce": "shared memory (this DeepSpeed has no switch: expect SIGILL at the first all-reduce)"}


def note_fallback(rec) -> None:
    """Before deepspeed.init_distributed (dsexp's worker, or a user's script's): switch the shared-memory all-reduce
    off where this CPU cannot run it, and record it in the rank's record (`all_reduce`), read from its `cpu`."""
    fallback = avoid_shm_allreduce(rec.record["cpu"])
    if fallback:
        rec.note(all_reduce=fallback)
