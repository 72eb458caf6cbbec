"""Turn how a job ended into a cause class, the failing rank and phase, and the last lines of each log."""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Optional

CAUSES = ("oom_gpu", "oom_host", "timeout", "rank_crashed", "config_rejected", "load_error", "engine_error",
          "kernel_build_error", "incorrect_output", "prepare_error", "launch_error")

_OOM_GPU = re.compile(r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|NCCL.*(out of memory|alloc)|"
                      r"Workspace can't be allocated", re.I)  # the last: DeepSpeed's kernel-injection workspace
_OOM_HOST = re.compile(r"\bMemoryError\b|Cannot allocate memory|std::bad_alloc|DefaultCPUAllocator: can't allocate", re.I)
_REJECTED = re.compile(r"ValidationError|validation error|Extra inputs are not permitted|is not supported by|"
                       r"not a valid|Cannot use both|Injection policy layer.*not valid|Not able to determine model policy", re.I)
# DeepSpeed's op builders (deepspeed/ops/op_builder/builder.py, cpu/no_impl.py) and torch.utils.cpp_extension.
_KERNEL = re.compile(r"op_builder|ninja|nvcc|Error building extension|This op had not been implemented|"
                     r"Unable to JIT load|CUDA_HOME does not exist|unable to compile CUDA op|MissingCUDAException|"
                     r"CUDAMismatchException|DeepSpeed JIT builder|version mismatch! DeepSpeed ops|"
                     r"no compute capabilities remaining", re.I)
# Config classes refusing a key or value, in whichever phase the config is built (zero.Init reads it at load).
_REJECTING_TYPES = ("ValidationError", "DeepSpeedConfigError")


def tail(path: Path, lines: int = 30) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 64 * 1024))
            return "\n".join(f.read().decode(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def log_tails(job_dir: Path, world_size: int) -> Dict[str, str]:
    out = {f"rank{r}": tail(Path(job_dir) / "ranks" / f"rank{r}.log") for r in range(world_size)}
    out["launcher"] = tail(Path(job_dir) / "launcher.log")
    return out


def classify(timed_out: bool, returncode: Optional[int], ranks: List[Optional[dict]],
             tails: Dict[str, str]) -> Optional[Dict[str, Any]]:
    """None if every rank finished ok; else {cause, rank, phase, type, message}."""
    if not timed_out and returncode == 0 and ranks and all(r and r.get("status") == "ok" for r in ranks):
        return None
    errors = [dict(r["error"], rank=r["rank"]) for r in ranks if r and r.get("error")]
    err = min(errors, key=lambda e: e.get("time", 0.0)) if errors else None
    if timed_out:
        return {"cause": "timeout", **_where(err, ranks), "message": "the job ran past timeout_s; ranks were killed"}
    if err is None:
        # No rank recorded an exception: it died from a signal or exited hard. Blame the rank that stopped earliest.
        rank, phase = _first_silent_stop(ranks)
        text = tails.get(f"rank{rank}", "") if rank is not None else ""
        cause = "oom_gpu" if _OOM_GPU.search(text) else "oom_host" if _OOM_HOST.search(text) else "rank_crashed"
        return {"cause": cause, "rank": rank, "phase": phase, "type": "exit",
                "message": f"rank {rank} stopped in phase {phase} without a Python error (launcher rc={returncode})"}
    text = f"{err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}"
    if err.get("type") in ("OutOfMemoryError",) or _OOM_GPU.search(text):
        cause = "oom_gpu"
    elif err.get("type") == "MemoryError" or _OOM_HOST.search(text):
        cause = "oom_host"
    elif _KERNEL.search(text):
        cause = "kernel_build_error"
    elif err.get("type") in _REJECTING_TYPES or (err.get("phase") == "init" and _REJECTED.search(text)):
        cause = "config_rejected"
    elif err.get("phase") == "load":
        cause = "load_error"
    else:
        cause = "engine_error"
    return {"cause": cause, "rank": err["rank"], "phase": err.get("phase"), "type": err.get("type"),
            "message": err.get("message")}


def _where(err: Optional[dict], ranks: List[Optional[dict]]) -> Dict[str, Any]:
    if err:
        return {"rank": err["rank"], "phase": err.get("phase")}
    rank, phase = _first_silent_stop(ranks)
    return {"rank": rank, "phase": phase}


def _first_silent_stop(ranks: List[Optional[dict]]):
    """The rank with the fewest completed phases (a missing record counts as none) and the phase it was in."""
    from dsexp.records import PHASES

    best = None
    for r, rec in enumerate(ranks):
        done = len((rec or {}).get("phases", {}))
        if rec is not None and rec.get("status") == "ok":
            continue
        if best is None or done < best[1]:
            best = (r, done)
    if best is None:
        return None, None
    return best[0], PHASES[min(best[1], len(PHASES) - 1)]
