"""A rank killed by SIGILL, named: the CPU executed an instruction it does not have (a kernel built for AVX-512 on a
CPU without it, an op JIT-built on another machine and found in a shared cache). The rank's log holds faulthandler's
dump ("Fatal Python error: Illegal instruction", then every thread's stack): its crashing thread's innermost frame
says which library or op was running. The rank's record holds its CPU's vector instruction sets (dsexp.core.cpu).
The failure gets `illegal_instruction`: {rank, frame, library, op, needs, cpu_lacks, fix}, and its message says it.
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.core.cpu import features
from dsexp.job.failures import tail

_FATAL = "Fatal Python error: Illegal instruction"
_CRASHED = re.compile(r"^(?:Current thread 0x[0-9a-f]+|Stack) \(most recent call first\):$", re.M)
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
_LIBRARY = re.compile(r"(?:site-packages|dist-packages|overlay)/([A-Za-z_][\w.]*)/")
# (frame pattern, the op, the instruction sets its kernels are built for, the fix)
KNOWN = (
    (
        re.compile(r"deepspeed/comm/(?:torch|ccl)\.py:\d+ in inference_all_reduce|shm_comm"),
        "DeepSpeed's CPU shared-memory all-reduce (deepspeed_shm_comm, csrc/cpu/comm/shm.cpp), its reduce kernels "
        "built for avx512bw",
        ["avx512bw"],
        "DeepSpeed 0.19.8 checks the CPU before it uses them and falls back to gloo's all_reduce; DeepSpeed <= 0.14.4 "
        "falls back where LOCAL_SIZE is not the number of ranks (dsexp sets LOCAL_SIZE=1 in the ranks on a CPU "
        "without avx512bw: rank/shm_fallback.py); 0.14.5 to 0.19.5 have no "
        "switch: run on a CPU with avx512bw or on DeepSpeed 0.19.8",
    ),
    (
        re.compile(r"torch_extensions|op_builder|jit_load|cpp_extension"),
        "an op JIT-built by DeepSpeed or torch.utils.cpp_extension (cached under TORCH_EXTENSIONS_DIR)",
        [],
        "a build cached by another machine is built for its CPU: remove it from TORCH_EXTENSIONS_DIR (or give each "
        "kind of CPU its own) so that it is rebuilt here",
    ),
)


def died_of_sigill(code: Optional[int], log: str) -> bool:
    return code == -signal.SIGILL or _FATAL in log


def crashing_frames(log: str) -> List[Dict[str, Any]]:
    """The crashing thread's frames, innermost first, from the last SIGILL dump in a rank's log."""
    at = log.rfind(_FATAL)
    if at < 0:
        return []
    m = _CRASHED.search(log, at)
    if not m:
        return []
    frames = []
    for line in log[m.end() :].lstrip("\n").splitlines():
        f = _FRAME.match(line)
        if not f:
            break
        frames.append({"file": f.group(1), "line": int(f.group(2)), "function": f.group(3)})
    return frames


def where(frame: Dict[str, Any]) -> str:
    return f"{Path(frame['file']).name}:{frame['line']} in {frame['function']}"


def library(frame: Dict[str, Any], script: Optional[str]) -> str:
    if script and Path(frame["file"]).name == Path(script).name and frame["file"].endswith(Path(script).name):
        return "the script"
    m = _LIBRARY.search(frame["file"].replace("\\", "/"))
    return m.group(1).split(".")[0] if m else Path(frame["file"]).name


def explain(rank: int, log: str, cpu: Optional[Dict[str, Any]], script: Optional[str] = None) -> Dict[str, Any]:
    """What a rank killed by SIGILL was running, what its CPU lacks and the fix."""
    frames = crashing_frames(log)
    cpu = cpu or features()
    lacks = list(cpu.get("lacks") or [])
    stack = " ".join(f"{f['file']}:{f['line']} in {f['function']}" for f in frames)
    op, needs, fix = None, [], None
    for pattern, what, sets, remedy in KNOWN:
        if pattern.search(stack):
            op, needs, fix = what, sets, remedy
            break
    top = frames[0] if frames else None
    lib = library(top, script) if top else None
    missing = [s for s in needs if s in lacks] or lacks
    if fix is None:
        fix = _generic_fix(lib, missing)
    return {
        "rank": rank,
        "frame": where(top) if top else None,
        "stack": [where(f) for f in frames[:8]],
        "library": lib,
        "op": op,
        "needs": needs,
        "cpu_lacks": lacks,
        "cpu_assumed_no_avx512": bool(cpu.get("assumed_no_avx512")),
        "fix": fix,
    }


def _generic_fix(lib: Optional[str], missing: List[str]) -> str:
    if not missing:
        return (
            f"this CPU has every vector set dsexp checks: {lib or 'the code'} was built for other instructions "
            "(a wheel or a cached op built on another machine): rebuild it here"
        )
    sets = few(missing)
    if lib == "the script":
        return f"the script's own code (or what it calls through ctypes) needs {sets}: run it on a CPU with them"
    return f"run it on a CPU with {sets}, or install a build of {lib or 'the library'} made for this CPU"


def few(sets: List[str], most: int = 4) -> str:
    return ", ".join(sets) if len(sets) <= most else f"{', '.join(sets[:most])} and {len(sets) - most} more"


def sentence(info: Dict[str, Any]) -> str:
    """One line: SIGILL, where, what the CPU lacks."""
    running = info["op"] or info["library"]
    at = f" at {info['frame']}" + (f" ({running})" if running else "") if info["frame"] else ""
    need = [s for s in info["needs"] if s in info["cpu_lacks"]]
    lacks = (
        f"; it needs {', '.join(need)}, which this CPU lacks" if need
        else f"; this CPU lacks {few(info['cpu_lacks'])}" if info["cpu_lacks"]
        else "; this CPU has every vector set dsexp checks"
    )  # fmt: skip
    assumed = " (as DSEXP_ASSUME_NO_AVX512=1 says)" if info["cpu_assumed_no_avx512"] else ""
    return f"rank {info['rank']} was killed by SIGILL (an illegal instruction){at}{lacks}{assumed}"


def name(
    failure: Optional[Dict[str, Any]],
    job_dir: Path,
    ranks: List[Optional[dict]],
    exits: Dict[int, int],
    script: Optional[str] = None,
) -> None:
    """Where the failing rank (or, failing that, another that failed) died of SIGILL: add `illegal_instruction` to
    the failure and say it in its message."""
    if not failure or failure.get("cause") not in ("rank_crashed", "launch_error", "script_error", "engine_error"):
        return
    order = [failure.get("rank")] + [r for r in range(len(ranks)) if r != failure.get("rank")]
    for r in (r for r in order if r is not None):
        rec = ranks[r] if r < len(ranks) else None
        if rec and rec.get("status") == "ok":
            continue
        log = tail(Path(job_dir) / "ranks" / f"rank{r}.log", 400)
        if died_of_sigill(exits.get(r), log):
            info = explain(r, log, (rec or {}).get("cpu"), script)
            failure.update(cause="rank_crashed", rank=r, type="signal", illegal_instruction=info)
            failure["message"] = f"{sentence(info)}. Fix: {info['fix']}"
            return
