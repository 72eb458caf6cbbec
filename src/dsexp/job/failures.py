"""Turn how a job ended into a cause class, the failing rank and phase, and the last lines of each log.

Evidence, per rank: its record (status, a recorded Python error with its time), its heartbeat (the
live file: the phase it was in and when it was last alive), whether it received SIGTERM (it then
leaves its stacks in rank{N}.terminated), the exit code the launcher reports (torchrun's failure
summary), and, for hangs, the Python stacks the ranks dumped before being killed. The failing rank
is the earliest to fail among ranks that were not collateral damage: ranks the launcher SIGTERMed
after another failed, and ranks whose error only says a peer went away, are blamed only when nobody
else can be. (Heartbeats alone can mislead: a rank spinning in a collective holds the GIL and stops
beating long before it is killed.)
"""

from __future__ import annotations

import re
import signal
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Tuple

from dsexp.core.protocol import STACK_IMPORT_ERROR
from dsexp.core.records import PHASES, phase_kind, phase_quantities, read_rank_records

CAUSES = (
    "oom_gpu",
    "oom_host",
    "timeout",
    "rank_crashed",
    "config_rejected",
    "load_error",
    "engine_error",
    "kernel_build_error",
    "incorrect_output",
    "prepare_error",
    "launch_error",
    "invalid_config",
    "interrupted",
    "stack_error",
    "reference_invalid",
    # a user's script (script.path): it raised or exited non-zero outside the calls dsexp observes
    "script_error",
    "no_engine_call",  # records before 2026-12-02: a script without an engine call (now an ok run's fact)
    # the cluster ended the job (dsexp.job.cluster.slurm): recorded by the sweep process from SLURM's final state
    "slurm_cancelled",
    "node_failed",
    "time_limit",
    "slurm_failed",
    "slurm_rejected",
)

_OOM_GPU = re.compile(
    r"CUDA out of memory|OutOfMemoryError|CUBLAS_STATUS_ALLOC_FAILED|NCCL.*(out of memory|alloc)|"
    r"Workspace can't be allocated",
    re.I,
)  # the last: DeepSpeed's kernel-injection workspace
_OOM_HOST = re.compile(
    r"\bMemoryError\b|Cannot allocate memory|std::bad_alloc|DefaultCPUAllocator: can't allocate", re.I
)
# (?<![A-Za-z]): pydantic's ValidationError, not huggingface_hub's HFValidationError (a repo id or path that does not
# exist: from_pretrained given a folder that is not there is no config DeepSpeed rejected)
_REJECTED = re.compile(
    r"(?<![A-Za-z])ValidationError|validation error|Extra inputs are not permitted|is not supported by|"
    r"not a valid|Cannot use both|Injection policy layer.*not valid|Not able to determine model policy",
    re.I,
)
# DeepSpeed's op builders (deepspeed/ops/op_builder/builder.py, cpu/no_impl.py) and torch.utils.cpp_extension.
_KERNEL = re.compile(
    r"op_builder|ninja|nvcc|Error building extension|This op had not been implemented|"
    r"Unable to JIT load|CUDA_HOME does not exist|unable to compile CUDA op|MissingCUDAException|"
    r"CUDAMismatchException|DeepSpeed JIT builder|version mismatch! DeepSpeed ops|"
    r"no compute capabilities remaining",
    re.I,
)
# Config classes refusing a key or value, in whichever phase the config is built (zero.Init reads it at load).
_REJECTING_TYPES = ("ValidationError", "DeepSpeedConfigError")
# A rank's error that only reports that a peer went away (gloo/NCCL/c10d store).
_COLLATERAL = re.compile(
    r"Connection (closed|reset) by peer|Broken pipe|ECONNRESET|communicator was aborted|"
    r"remote process exited|DistNetworkError|DistStoreError|Connection refused|failed to recv",
    re.I,
)
# torchrun's failure summary: "rank      : 1 (local_rank: 1)\n  exitcode  : -9 (pid: 123)"
_EXIT = re.compile(r"rank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)\s*\n\s*exitcode\s*:\s*(-?\d+)")
# A frame in a faulthandler dump: '  File "/x/torch/distributed/distributed_c10d.py", line 2800 in all_reduce'
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')
_COLLECTIVE = re.compile(
    r"distributed_c10d|deepspeed/comm/|all_reduce|all_gather|reduce_scatter|barrier|broadcast", re.I
)
_NODE_FULL = 0.95  # a SIGKILLed rank with the node this full is taken as killed by the OOM killer


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


def launcher_exits(job_dir: Path) -> Dict[int, int]:
    """Exit code per rank from torchrun's failure summary (negative: killed by that signal); {} if none."""
    return {int(r): int(c) for r, c in _EXIT.findall(tail(Path(job_dir) / "launcher.log", 2000))}


def terminated_ranks(job_dir: Path, world_size: int) -> List[int]:
    """Ranks that received SIGTERM (their faulthandler wrote rank{N}.terminated)."""
    out = []
    for r in range(world_size):
        path = Path(job_dir) / "ranks" / f"rank{r}.terminated"
        if path.is_file() and path.stat().st_size > 0:
            out.append(r)
    return out


def oom_kills() -> Optional[int]:
    """The cgroup's OOM-kill counter (cgroup v2 memory.events, or v1 memory.oom_control); None if unreadable."""
    for path in ("/sys/fs/cgroup/memory.events", "/sys/fs/cgroup/memory/memory.oom_control"):
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        except (OSError, ValueError):
            continue
    return None


def hang_site(log_text: str) -> Tuple[Optional[str], bool]:
    """From the last faulthandler dump in a rank's log: the main thread's innermost frame and whether that
    thread was inside a collective (waiting for peers) rather than stuck on its own."""
    blocks = re.split(r"\n(?=(?:Current thread|Thread) 0x[0-9a-f]+ )", log_text)
    main = [b for b in blocks if "(most recent call first)" in b and "_run_module_as_main" in b]
    if not main:
        return None, False
    frames = [m.groups() for m in (_FRAME.match(line) for line in main[-1].splitlines()) if m]
    if not frames:
        return None, False
    inner = f"{Path(frames[0][0]).name}:{frames[0][1]} in {frames[0][2]}"
    return inner, any(_COLLECTIVE.search(f"{f[0]} {f[2]}") for f in frames)


def classify(
    timed_out: bool,
    returncode: Optional[int],
    ranks: List[Optional[dict]],
    tails: Dict[str, str],
    exits: Optional[Dict[int, int]] = None,
    oom_killed: bool = False,
    hangs: Optional[Dict[int, Tuple[Optional[str], bool]]] = None,
    terminated: Iterable[int] = (),
) -> Optional[Dict[str, Any]]:
    """None if every rank finished ok; else {cause, rank, phase, type, message, ranks_at_stop}."""
    if not timed_out and returncode == 0 and ranks and all(r and r.get("status") == "ok" for r in ranks):
        return None
    exits = {**(exits or {}), **{r: -signal.SIGTERM for r in terminated}}  # stopped by someone else first
    at_stop = {r: _phase_at_stop(rec) for r, rec in enumerate(ranks) if not (rec and rec.get("status") == "ok")}
    if timed_out:
        out = _timeout(ranks, at_stop, hangs or {})
    elif not any(ranks) or not at_stop:  # no rank ever started, or all finished and the launcher still failed
        last = _last_line(tails.get("launcher")) or "(empty launcher.log)"
        out = {
            "cause": "launch_error",
            "rank": None,
            "phase": None,
            "type": "launcher",
            "message": f"the launcher exited with rc={returncode}: {last}{_launcher_took_the_scripts(last)}",
        }
    else:
        rank = _culprit(ranks, exits, at_stop)
        rec = ranks[rank]
        err = (rec or {}).get("error")
        tail = tails.get(f"rank{rank}", "")
        out = _from_error(err) if err else _from_silent_stop(rank, rec, exits.get(rank), returncode, tail, oom_killed)
        said = _last_line(tail) if (err or {}).get("type") == "SystemExit" else ""  # sys.exit(2) says why only there
        if said:
            out["message"] += f"; its last output: {said}"
        out = {"rank": rank, "phase": (err or {}).get("phase") or at_stop.get(rank), **out}
    out["ranks_at_stop"] = {f"rank{r}": p for r, p in at_stop.items()}
    return out


_AMBIGUOUS = re.compile(r"error: ambiguous option: (--?[\w-]+)")


def _launcher_took_the_scripts(last: str) -> str:
    """argparse in torchrun and DeepSpeed's runner reads a script argument such as `--n` as an abbreviation of the
    launcher's own options (dsexp passes the launcher none), and plain torchrun fails the same way."""
    m = _AMBIGUOUS.search(last)
    if not m:
        return ""
    return (
        f" (the launcher read the script's argument {m.group(1)} as an abbreviation of its own options, as it would "
        "outside dsexp: rename the script's option so that no launcher option begins with it)"
    )


def _last_line(log: Optional[str]) -> str:
    """The last non-empty line of a log, at most 500 characters ('' where it holds nothing)."""
    lines = (log or "").strip().splitlines()
    return lines[-1].strip()[:500] if lines else ""


_PHASE_ORDER = {p: i for i, p in enumerate(PHASES)}  # rank "furthest behind" = lowest


def _phase_at_stop(rec: Optional[dict]) -> Optional[str]:
    """The phase a rank was in when it stopped: its failed or partial phase, else the one after its last."""
    if not rec:
        return PHASES[0]
    if rec.get("error"):
        return rec["error"].get("phase")
    phases = rec.get("phases") or {}
    partial = [p for p, v in phases.items() if v.get("partial")]
    if partial:
        return partial[-1]
    if rec.get("script") is not None:  # a user's script: between its observed calls, after the last one it ended
        timeline = rec.get("timeline") or []
        return f"after_{timeline[-1]['phase']}" if timeline else "start"
    # the first phase not recorded; `quantize` only runs with a quant member, which its live file would have named
    following = [p for p in PHASES if p not in phases and p != "quantize"]
    return following[0] if following else PHASES[-1]


def only_a_peer_went_away(err: Dict[str, Any]) -> bool:
    """A recorded error that only reports that a peer went away (gloo/NCCL/c10d store)."""
    return bool(_COLLATERAL.search(f"{err.get('message')}\n{err.get('traceback', '')}"))


def _is_victim(rank: int, rec: Optional[dict], exits: Dict[int, int]) -> bool:
    if exits.get(rank) == -signal.SIGTERM:
        return True  # the launcher stopped it because another rank failed
    err = (rec or {}).get("error")
    if (err or {}).get("stopped"):
        return bool(err.get("after_rank") is not None)  # recorded by record_how_ranks_ended, after another's failure
    return bool(err) and only_a_peer_went_away(err)


def _culprit(ranks: List[Optional[dict]], exits: Dict[int, int], at_stop: Dict[int, Optional[str]]) -> int:
    """Among the ranks that did not finish (the keys of at_stop, never empty here): the earliest-failing one that
    was not collateral damage (else the earliest of all). Without times (no heartbeat, no error), the rank
    furthest behind."""
    failed = list(at_stop)
    primary = [r for r in failed if not _is_victim(r, ranks[r], exits)] or failed

    def when(r: int) -> float:
        rec = ranks[r] or {}
        t = (rec.get("error") or {}).get("time") or rec.get("last_alive")
        return float(t) if t is not None else float("inf")

    return min(primary, key=lambda r: (when(r), _PHASE_ORDER.get(at_stop[r], len(PHASES)), r))


def record_how_ranks_ended(
    ranks: List[Optional[dict]], failure: Optional[Dict[str, Any]], exits: Dict[int, int], returncode: Optional[int]
) -> None:
    """Every rank that did not finish ok and recorded no error of its own (torn down after another rank failed,
    killed by a signal, exited hard) gets one: the phase it was in (or after), and how it stopped."""
    culprit = (failure or {}).get("rank")
    for r, rec in enumerate(ranks):
        if rec is None or rec.get("status") == "ok" or rec.get("error"):
            continue
        code = exits.get(r)
        how = (
            f"killed by {_signal_name(-code)}" if code is not None and code < 0
            else f"exited with code {code}" if code is not None
            else f"stopped (launcher rc={returncode})"
        )  # fmt: skip
        after = f" after rank {culprit} failed" if culprit is not None and culprit != r else ""
        rec["error"] = {
            "phase": _phase_at_stop(rec),
            "type": "Stopped",
            "message": f"rank {r} {how}{after}, without an error of its own",
            "time": rec.get("last_alive"),
            "stopped": True,
            **({"after_rank": culprit} if after else {}),
        }
        rec["status"] = "failed"


def _from_error(err: dict) -> Dict[str, Any]:
    text = f"{err.get('type')}: {err.get('message')}\n{err.get('traceback', '')}"
    if err.get("type") == STACK_IMPORT_ERROR:
        cause = "stack_error"
    elif err.get("type") in ("OutOfMemoryError",) or _OOM_GPU.search(text):
        cause = "oom_gpu"
    elif err.get("type") == "MemoryError" or _OOM_HOST.search(text):
        cause = "oom_host"
    elif _KERNEL.search(text):
        cause = "kernel_build_error"
    elif err.get("type") in _REJECTING_TYPES or (
        (phase_kind(err.get("phase") or "") == "init" or err.get("outside_calls")) and _REJECTED.search(text)
    ):
        cause = "config_rejected"  # also a user's script building a config DeepSpeed rejects (outside the call)
    elif err.get("outside_calls"):
        cause = "script_error"  # a user's script raised, or exited non-zero, outside the library calls dsexp observes
    elif phase_kind(err.get("phase") or "") == "load":
        cause = "load_error"
    else:
        cause = "engine_error"
    message = f"{err.get('type')}: {err.get('message')}" if err.get("message") else str(err.get("type"))
    out = {"cause": cause, "type": err.get("type"), "message": message}
    if err.get("site"):
        out["site"] = err["site"]  # the model's module the error came from (rank/probes/failure_site.py)
    return out


def _from_silent_stop(
    rank: Optional[int], rec: Optional[dict], code: Optional[int], returncode: Optional[int], log: str, oom_killed: bool
) -> Dict[str, Any]:
    """A rank that stopped without a Python error: it exited hard or a signal killed it."""
    if code is not None and code < 0:
        how = f"was killed by {_signal_name(-code)}"
    elif code is not None:
        how = f"exited with code {code}"
    else:
        how = f"stopped (launcher rc={returncode})"
    fill = _node_fill(rec)
    sigkill = code is None or code == -signal.SIGKILL
    if _OOM_GPU.search(log):
        cause = "oom_gpu"
    elif _OOM_HOST.search(log):
        cause, how = "oom_host", how + " (its log reports a failed host allocation)"
    elif sigkill and oom_killed:
        cause, how = "oom_host", how + " (the kernel OOM killer: the cgroup counted an OOM kill)"
    elif sigkill and (fill or 0) >= _NODE_FULL:
        cause, how = "oom_host", how + f" (likely the kernel OOM killer: node memory was {fill:.0%} used)"
    else:
        cause = "rank_crashed"
    return {
        "cause": cause,
        "type": "signal" if code is not None and code < 0 else "exit",
        "message": f"rank {rank} {how} without a Python error",
    }


def _timeout(
    ranks: List[Optional[dict]], at_stop: Dict[int, Optional[str]], hangs: Dict[int, Tuple[Optional[str], bool]]
) -> Dict[str, Any]:
    """Blame the rank that was furthest behind, preferring one stuck on its own over one waiting in a collective."""
    if not at_stop:
        return {
            "cause": "timeout",
            "rank": None,
            "phase": None,
            "type": "timeout",
            "message": "the job ran past timeout_s after every rank had finished",
        }
    rank = min(
        at_stop, key=lambda r: (_PHASE_ORDER.get(at_stop[r], len(PHASES)), bool((hangs.get(r) or (None, False))[1]), r)
    )
    where = "; ".join(
        f"rank {r} in {at_stop[r]}"
        + (f" at {hangs[r][0]}" + (" (in a collective)" if hangs[r][1] else "") if hangs.get(r) and hangs[r][0] else "")
        for r in sorted(at_stop, key=lambda r: r != rank)
    )
    return {
        "cause": "timeout",
        "rank": rank,
        "phase": at_stop[rank],
        "type": "timeout",
        "message": f"ran past timeout_s, ranks killed; {where}",
    }


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _node_fill(rec: Optional[dict]) -> Optional[float]:
    """Highest node-memory use the rank saw, as a fraction of the node's memory."""
    phases = (rec or {}).get("phases") or {}
    total = max([(p.get("host") or {}).get("node_total", 0) for p in phases.values()] + [0])
    used = max([(p.get("peaks") or {}).get("node_used_peak", 0) for p in phases.values()] + [0])
    if not total:
        import psutil

        total = psutil.virtual_memory().total
    return used / total if used else None


def reached(job_dir: Path, world_size: int) -> Dict[str, Any]:
    """What the ranks of a job stopped from outside (Ctrl-C, SIGTERM, SLURM) had reached, from their files: the
    phase each unfinished rank was in, the memory each reached and the last lines of every log. No rank files
    at all (stopped while the job was still preparing): ranks_at_stop is empty."""
    ranks = read_rank_records(job_dir, world_size)
    if not any(ranks):
        return {"ranks_at_stop": {}, "log_tails": log_tails(job_dir, world_size)}
    return {
        "ranks_at_stop": {
            f"rank{r}": _phase_at_stop(rec) for r, rec in enumerate(ranks) if not (rec and rec.get("status") == "ok")
        },
        "memory_reached": memory_reached(ranks),
        "log_tails": log_tails(job_dir, world_size),
    }


REACHED = ("host_rss", "host_anon", "nvml_device_used", "gpu_reserved", "gpu_alloc")


def memory_reached(ranks: List[Optional[dict]]) -> Dict[str, Dict[str, float]]:
    """Per rank, the highest host and device memory seen in any phase up to the failure (GiB)."""
    out = {}
    for rec in ranks:
        if not rec:
            continue
        peaks: Dict[str, float] = {}
        for ph in (rec.get("phases") or {}).values():
            q = phase_quantities(ph)
            for name in REACHED:
                for v in (q.get(f"{name}_gib"), q.get(f"{name}_peak_gib")):  # the snapshot and the sampler's peak
                    if v is not None:
                        peaks[f"{name}_gib"] = max(peaks.get(f"{name}_gib", 0.0), v)
        out[f"rank{rec['rank']}"] = peaks
    return out
