"""One experiment, end to end, in the Hydra job process: prepare, launch ranks, aggregate, record, track.

Whatever happens after validation, the job ends with a `result.json` (ok or failed with a cause)
and returns normally, so a multirun goes on and its end-of-sweep summary still runs.

Resume: in a multirun, a job whose configuration (its key) already has an ok result anywhere in the
sweep folder is skipped (`rerun=true` forces it). Any other job runs again; what an earlier attempt
left in the job folder (result.json, ranks/, logs) is moved to `.dsexp/attempts/<n>/` first, never overwritten
(hidden, so tools that collect every result.json below a sweep do not count earlier attempts).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

from dsexp.core import records
from dsexp.core.checkpoint import checkpoint_problem
from dsexp.core.fs import read_json, write_json_atomic
from dsexp.core.protocol import CAMPAIGN_ENV, COMMIT_ENV, RESULT, STACK_IMPORT_ERROR, write_job_file
from dsexp.core.schema import JobConfig, dtype_conversion
from dsexp.core.series import read_job_series
from dsexp.core.workload import grid
from dsexp.job import correctness, failures, illegal_instruction, oom_relaunch, script_job, stack_cpu, teardown
from dsexp.job.budget import budget_runtime
from dsexp.job.cluster import slurm
from dsexp.job.launch import LaunchOutcome, run_ranks
from dsexp.job.overlay import StackError, prepare_stack
from dsexp.job.overlay import rank_env as overlay_env
from dsexp.job.roles import RoleFailed

ATTEMPTS = Path(".dsexp") / "attempts"
_ATTEMPT_FILES = (RESULT, "job.json", "launcher.log", "ranks", "reference", "trace.json")


def source_commit() -> Optional[str]:
    """The git commit of the dsexp source tree this process runs ("-dirty" when tracked files differ from it), or
    None where it is no git checkout (an installed wheel, a copied tree)."""
    src = Path(__file__).resolve().parents[1]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(src), *args], capture_output=True, text=True, timeout=10).stdout

    try:
        sha = git("rev-parse", "HEAD").strip()
        return sha and sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except (OSError, subprocess.SubprocessError):
        return None


def provenance() -> Dict[str, str]:
    """What made this result: the campaign (`python -m dsexp.campaign` sets $DSEXP_CAMPAIGN) and the commit
    ($DSEXP_COMMIT where the campaign set it, else this source tree's)."""
    out = {"campaign": os.environ.get(CAMPAIGN_ENV), "commit": os.environ.get(COMMIT_ENV) or source_commit()}
    return {k: v for k, v in out.items() if v}


def job_key(spec: JobConfig) -> str:
    """Identity of a configuration (what is measured), for resume and cache lookups; a script's content is part
    of it (an edited script is another configuration)."""
    d = asdict(spec)
    for k in ("tracking", "rerun", "timeout_s"):
        d.pop(k, None)
    if not spec.budget.active:  # no budget: the key of every result recorded before budgets existed
        d.pop("budget", None)
    if spec.script.path:
        d["script_sha1"] = script_job.digest(spec.script.path)
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def find_ok_result(sweep_dir: Path, key: str) -> Optional[dict]:
    """An ok result for this key already in the sweep, also among archived attempts (resume)."""
    paths = sorted(Path(sweep_dir).glob(f"*/{RESULT}")) + sorted(Path(sweep_dir).glob(f"*/{ATTEMPTS}/*/{RESULT}"))
    for path in paths:
        res = read_json(path)
        if res and res.get("key") == key and res.get("status") == "ok":
            return res
    return None


def prepare_model(spec: JobConfig) -> Dict[str, Any]:
    """Make sure the checkpoint exists (write it if it is a preset); return runtime facts about it."""
    if spec.model.path:
        return {"model_dir": str(Path(spec.model.path).expanduser().resolve()), "checkpoint_written": False}
    from dsexp.models.writer import cached_checkpoint

    args = checkpoint_args(spec)
    folder = cached_checkpoint(**args)  # a hit needs no writer process (it imports torch and transformers)
    if folder is not None:
        return {"model_dir": str(folder), "checkpoint_written": False}
    proc = subprocess.run(
        [sys.executable, "-m", "dsexp.models.writer", json.dumps(args)], capture_output=True, text=True, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(f"writing the {spec.model.name} checkpoint failed:\n{proc.stderr[-3000:]}")
    st = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        "model_dir": st["path"],
        "checkpoint_written": not st["cache_hit"],
        "checkpoint_write_s": st["seconds"],
        "checkpoint_bytes": st["bytes"],
    }


def checkpoint_args(spec: JobConfig) -> Dict[str, Any]:
    """The model group's checkpoint as dsexp.models.writer keys it (a preset's or a config folder's)."""
    m = spec.model
    return dict(
        cache_dir=spec.cache_dir,
        name=m.name,
        arch=m.arch,
        dims=dict(m.dims),
        dtype=m.dtype,
        fmt=spec.load.format,
        seed=m.seed,
        shard_mb=m.shard_mb,
        **(
            {"config_path": str(Path(m.config_path).expanduser().resolve()), "trust_remote_code": m.trust_remote_code}
            if m.config_path
            else {}
        ),
    )


def baseline(device: str, gpus: Optional[List[int]] = None) -> Dict[str, Any]:
    """Node and device memory (and the cgroup's OOM-kill count) before launch, to check the teardown against.

    gpus: the NVML indices of a packed job's own GPUs (the others belong to other jobs)."""
    from dsexp.rank.probes.host import node_used

    out: Dict[str, Any] = {"node_used": node_used(), "oom_kills": failures.oom_kills()}
    if device == "cuda":
        out["gpu_used"] = teardown.gpu_used(gpus)
    return out


def archive_attempt(job_dir: Path) -> List[Dict[str, Any]]:
    """Move what an earlier attempt left in job_dir to .dsexp/attempts/<n>/; return a summary of every earlier
    attempt."""
    leftovers = [job_dir / name for name in _ATTEMPT_FILES if (job_dir / name).exists()]
    if leftovers:
        dest = job_dir / ATTEMPTS / str(len(list((job_dir / ATTEMPTS).glob("*"))) + 1)
        dest.mkdir(parents=True)
        for path in leftovers:
            path.rename(dest / path.name)
    return attempt_summary(job_dir)


def attempt_summary(job_dir: Path) -> List[Dict[str, Any]]:
    """One entry per earlier attempt archived under .dsexp/attempts/ (status, cause, key, MLflow run)."""
    summary = []
    for folder in sorted((job_dir / ATTEMPTS).glob("*"), key=lambda p: int(p.name) if p.name.isdigit() else 0):
        res = read_json(folder / RESULT) or {}
        summary.append(
            {
                "dir": str(folder),
                "status": res.get("status", "unfinished"),
                "cause": (res.get("failure") or {}).get("cause"),
                "key": res.get("key"),
                "run_id": (res.get("tracking") or {}).get("run_id"),
            }
        )
    return summary


class CheckpointError(RuntimeError):
    """The checkpoint folder fails the integrity check (before launch): a load_error naming the file."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM to the job process (scancel, a supervisor) unwinds like Ctrl-C, so the ranks are torn down."""


def _on_sigterm(signum, frame):
    raise Interrupted(f"signal {signal.Signals(signum).name}")


def run_job(spec: JobConfig, job_dir: Path, sweep_dir: Optional[Path] = None) -> Dict[str, Any]:
    """Run a validated job and always return a result dict (also written to result.json)."""
    key = job_key(spec)
    job_dir = Path(job_dir)
    if sweep_dir is not None and not spec.rerun:
        prior = find_ok_result(sweep_dir, key)
        if prior is not None:
            return {**prior, "resumed_from": prior.get("job_dir")}
    job_dir.mkdir(parents=True, exist_ok=True)
    stale = teardown.reap_stale(job_dir)
    earlier = archive_attempt(job_dir)  # a retried job starts clean and loses nothing
    result: Dict[str, Any] = {
        "schema": records.SCHEMA_VERSION,
        "key": key,
        "job_dir": str(job_dir),
        "config": asdict(spec),
        "started": time.time(),
        "status": "running",
        "attempt": len(earlier) + 1,
        "attempt_id": uuid.uuid4().hex,
        "earlier_attempts": earlier,
        "stale_reaped": stale,
        **provenance(),
    }
    allocation = slurm.env_facts()  # run as a SLURM job: its id and node (the final state is added by the sweep)
    if allocation:
        result["slurm"] = allocation
    main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if main_thread else None
    t0 = time.perf_counter()
    try:
        with _packing(spec, job_dir, sweep_dir) as packed:
            result["packed"] = packed
            _execute(spec, job_dir, result)
    except Exception as e:  # preparation failed (or SLURM's time limit came): still a result
        failure = {
            "cause": _preparation_cause(e),
            "type": type(e).__name__,
            "message": str(e)[:2000],
            "traceback": traceback.format_exc()[-4000:],
        }
        if failure["cause"] == "time_limit":  # stopped from outside, like an interrupt: what had the ranks reached?
            failure["message"] = f"SLURM's time limit is near (submitit got its signal): {e}"[:2000]
            failure.update(failures.reached(job_dir, spec.tp))
        if isinstance(e, correctness.ReferenceInvalid):  # the versions its reference ran on
            result["software"] = e.software
        result.update(status="failed", failure=failure)
    except KeyboardInterrupt as e:  # the ranks are already torn down (launch's finally); record, then stop
        result.update(
            status="failed",
            failure={
                "cause": "interrupted",
                "type": type(e).__name__,
                "message": f"the job was interrupted ({e or 'Ctrl-C'})",
                **failures.reached(job_dir, spec.tp),
            },
        )
        raise
    finally:
        if main_thread:
            signal.signal(signal.SIGTERM, previous)
        write_job_trace(job_dir, result, spec.tp)
        result["wall_s"] = time.perf_counter() - t0
        result["clock"] = {"started": result["started"], "ended": time.time()}
        if result.get("packed") is None:
            result.pop("packed", None)
        if allocation and slurm.recorded_by_sweep(job_dir, allocation["job_id"]):
            # SLURM declared the job over (its node failed) and the sweep recorded it while this process was
            # still being stopped: keep that record (it is in MLflow) and put this late view beside it
            write_json_atomic(job_dir / ".dsexp" / "late-result.json", result)
        else:
            write_json_atomic(job_dir / RESULT, result)
    return result


def write_job_trace(job_dir: Path, result: Dict[str, Any], world_size: int) -> None:
    """trace.json from what the ranks left, whatever the outcome (a job stopped from outside has not read their
    records or series yet: they are read here); result["trace"] names it. Never raises: the result comes first."""
    if not (job_dir / "ranks").is_dir():
        return
    try:
        from dsexp.core.trace import TRACE, write_trace

        if "series" not in result:
            result["series"] = read_job_series(job_dir, world_size)
        view = result if result.get("ranks") else {**result, "ranks": records.read_rank_records(job_dir, world_size)}
        earlier = [launch_records(Path(launch["dir"]), world_size) for launch in result.get("launches") or []]
        if write_trace(view, job_dir / TRACE, earlier):
            result["trace"] = TRACE
    except Exception as e:
        result["trace_error"] = f"{type(e).__name__}: {e}"[:500]


def launch_records(launch_dir: Path, world_size: int) -> Dict[str, Any]:
    """An archived launch's rank records and series (dsexp.job.oom_relaunch.archive_launch keeps its ranks/ there)."""
    return {
        "ranks": records.read_rank_records(launch_dir, world_size),
        "series": read_job_series(launch_dir, world_size),
    }


def _packing(spec: JobConfig, job_dir: Path, sweep_dir: Optional[Path]):
    """launcher.pack=true in a sweep: hold GPUs of the job's own for the whole job (see dsexp.packing)."""
    if not spec.launcher.pack or sweep_dir is None:
        return contextlib.nullcontext()
    from dsexp.job.cluster import packing

    return packing.claim(sweep_dir, job_dir, spec.ranks_per_node)


def prepare_load(spec: JobConfig, runtime: Dict[str, Any], job_dir: Path) -> Dict[str, Any]:
    """Before launch: the dtype conversion the ranks will do while loading, and load=sharded's per-rank split
    (which converts once, so its ranks convert nothing)."""
    if spec.load.name != "sharded":
        return {"conversion": dtype_conversion(spec.model.dtype, spec.dtype)}
    from dsexp.job.split import ensure_split

    return {"conversion": None, "split": ensure_split(spec, runtime, Path(job_dir))}


def cache_use(spec: JobConfig, runtime: Dict[str, Any]) -> Dict[str, str]:
    """What the job found cached: hit (reused), miss (computed now) or none (not needed), for the random-weight
    checkpoint, the tp=1 reference logits and the per-rank split of load=sharded."""

    def state(hit: Optional[bool]) -> str:
        return "none" if hit is None else "hit" if hit else "miss"

    return {
        "checkpoint": state(None if spec.model.path or not spec.uses_model else not runtime.get("checkpoint_written")),
        "reference": state(runtime.get("reference_cache_hit")),
        "split": state((runtime.get("split") or {}).get("cache_hit")),
    }


def after_teardown(device: str, base: Dict[str, Any], gpus: Optional[List[int]] = None) -> Dict[str, Any]:
    """Memory once the ranks are gone; on a GPU machine, wait (bounded) for the devices to return to baseline."""
    from dsexp.rank.probes.host import node_used

    out: Dict[str, Any] = {"node_used_after": node_used(), "oom_kills": failures.oom_kills()}
    if device == "cuda":
        out.update(teardown.wait_gpu_baseline(base.get("gpu_used"), indices=gpus))
    return out


def record_invalid(config: Dict[str, Any], job_dir: Path, message: str) -> Dict[str, Any]:
    """A multirun job whose settings fail validation at run time (the up-front check passed: e.g. a GPU went
    away) is a failed result too, so the sweep goes on. `config`: the job's settings as plain data."""
    job_dir = Path(job_dir)
    job_dir.mkdir(parents=True, exist_ok=True)
    result = {
        "schema": records.SCHEMA_VERSION,
        "key": None,
        "job_dir": str(job_dir),
        "config": config,
        "started": time.time(),
        "status": "failed",
        "attempt_id": uuid.uuid4().hex,
        "earlier_attempts": archive_attempt(job_dir),
        "failure": {"cause": "invalid_config", "rank": None, "phase": None, "type": "ConfigError", "message": message},
        **provenance(),
    }
    allocation = slurm.env_facts()
    if allocation:
        result["slurm"] = allocation
    write_json_atomic(job_dir / RESULT, result)
    return result


def incorrect_output_message(c: Dict[str, Any], ranks: List[Optional[dict]]) -> str:
    """What is wrong with the output: non-finite logits (and what held NaN/inf), a shape, or the error size."""
    if c.get("logits_rel_err") is None:
        held = (ranks[0] or {}).get("nonfinite") if ranks else None
        return c["message"] + (f"; not finite on rank 0: {', '.join(held[:8])}" if held else "")
    return (
        f"first-step logits differ from the tp=1 reference: rel. L2 error "
        f"{c['logits_rel_err']:.3g} > tolerance {c['tolerance']:.3g}"
    )


def prepare(spec: JobConfig, job_dir: Path) -> Tuple[Dict[str, Any], Any]:
    """Before launch: the ranks' software stack, the checkpoint where the workload uses one, and the workload's own
    preparation (the pipeline: its tp=1 reference and load=sharded's split; a script: its facts, its reference).
    Returns (the runtime facts the ranks read, the reference to check the output against or None)."""
    runtime: Dict[str, Any] = {"device": spec.device, "stack": prepare_stack(spec.stack, spec.cache_dir)}
    stack_cpu.check(runtime["stack"], {**os.environ, **overlay_env(runtime["stack"])})  # its wheels run on this CPU
    if spec.uses_model:
        runtime.update(prepare_model(spec))
        problem = checkpoint_problem(Path(runtime["model_dir"]))
        if problem:
            raise CheckpointError(f"checkpoint {runtime['model_dir']}: {problem}")
    if spec.shared_gpu:
        runtime["shared_gpu"] = True  # ranks share GPUs over gloo: per-rank memory is real, speed is not
    if spec.workload == "script":
        runtime.update(workload="script", script=script_job.facts(spec, runtime))
        ref = script_job.ensure_reference(spec, runtime, job_dir) if spec.check.correctness else None
        runtime.update(budget_runtime(spec, runtime))  # a CPU run under a budget: what its generate calls simulate
    else:
        ref = correctness.ensure_reference(spec, runtime, job_dir) if spec.check.correctness else None
        runtime.update(prepare_load(spec, runtime, job_dir))
        runtime.update(budget_runtime(spec, runtime))  # a CPU run under a budget: what its ranks simulate
    runtime["cache"] = cache_use(spec, runtime)
    return runtime, ref


def _preparation_cause(e: Exception) -> str:
    """The cause class of a job that failed before its measured ranks ran (or was stopped by SLURM's time limit:
    submitit raises in the job when SLURM signals that the limit is near)."""
    if slurm.is_time_limit_error(e):
        return "time_limit"
    if isinstance(e, CheckpointError):
        return "load_error"
    if isinstance(e, StackError) or (isinstance(e, RoleFailed) and e.error.get("type") == STACK_IMPORT_ERROR):
        return "stack_error"
    if isinstance(e, correctness.ReferenceInvalid):
        return "reference_invalid"
    return "prepare_error"


def launch_for_points(
    spec: JobConfig, job_dir: Path, runtime: Dict[str, Any], visible: Optional[str]
) -> Tuple[LaunchOutcome, List[Optional[dict]], List[Dict[str, Any]]]:
    """Launch the ranks; where a rank ran out of memory alone and ended them (dsexp.job.oom_relaunch), launch them again
    for the grid's points left. Every launch shares the job's timeout_s: a relaunch gets what the earlier ones left.
    Returns the last launch, the rank records (every launch's points merged) and a summary of each earlier launch."""
    earlier: List[List[Optional[dict]]] = []
    launches: List[Dict[str, Any]] = []
    deadline = time.monotonic() + spec.timeout_s
    while True:
        left_s = max(1.0, deadline - time.monotonic())
        outcome = run_ranks(spec, job_dir, spec.device, visible, runtime["stack"], runtime.get("script"), left_s)
        ranks = records.read_rank_records(job_dir, spec.tp)
        ended = oom_relaunch.ended_by_oom(ranks) if not outcome.timed_out else None
        if ended is None:
            break
        oom_relaunch.mark_torn_down(job_dir, ranks, ended)
        left = oom_relaunch.points_left(spec.generate, [*earlier, ranks])
        if not left or len(launches) >= len(grid(spec.generate)):
            break
        launches.append(oom_relaunch.archive_launch(job_dir, ranks, outcome.to_dict(), left))
        earlier.append(ranks)
        outcomes = oom_relaunch.recorded_points(earlier)  # a batch search goes on from them
        write_job_file(job_dir, spec, {**runtime, "points": [p.to_dict() for p in left], "outcomes": outcomes})
    if earlier or ended:
        ranks = oom_relaunch.merge_launches(earlier, ranks, spec.generate)
    return outcome, ranks, launches


def _execute(spec: JobConfig, job_dir: Path, result: Dict[str, Any]) -> None:
    from dsexp.job.cluster.packing import gpu_indices

    packed = result.get("packed")  # this job's GPUs under launcher.pack=true
    gpus = gpu_indices(packed)
    runtime, ref = prepare(spec, job_dir)
    write_job_file(job_dir, spec, runtime)
    result["runtime"] = runtime
    result["baseline"] = base = baseline(spec.device, gpus)
    outcome, ranks, launches = launch_for_points(spec, job_dir, runtime, (packed or {}).get("gpus"))
    # the last launch's ranks were ended by a rank out of memory alone
    ended = oom_relaunch.ended_by_oom(ranks) if not outcome.timed_out else None
    if launches:
        result["launches"] = launches
    result["launch"] = launch = outcome.to_dict()
    result["teardown"] = {**launch.pop("teardown", {}), **after_teardown(spec.device, base, gpus)}
    tails = failures.log_tails(job_dir, spec.tp)
    result["ranks"] = ranks
    result["series"] = read_job_series(job_dir, spec.tp)
    result["metrics"] = records.aggregate_metrics(ranks)
    new_tokens = script_job.new_tokens(ranks) if spec.workload == "script" else spec.generate.new_tokens
    result["headline"] = records.headline(result["metrics"], ranks, new_tokens, spec.shared_gpu)
    if spec.workload == "script":  # every generate call and sequence; one-time costs apart; weights without an engine
        result["headline"].update(script_job.generation_speed(ranks))
        script_job.without_one_time(result["headline"], ranks)
        result["headline"].setdefault("gpu_weights_gib", None)
        if result["headline"]["gpu_weights_gib"] is None:
            result["headline"]["gpu_weights_gib"] = script_job.weights_held_gib(ranks)
    result["engine"] = (ranks[0] or {}).get("engine") if ranks else None
    result["software"] = (ranks[0] or {}).get("software") if ranks else None
    # DeepSpeed's CPU shared-memory all-reduce switched off (a CPU without avx512bw): what the ranks did and why
    result["all_reduce"] = next((rk["all_reduce"] for rk in ranks if rk and rk.get("all_reduce")), None)
    hangs = (
        {r: failures.hang_site(failures.tail(job_dir / "ranks" / f"rank{r}.log", 400)) for r in range(spec.tp)}
        if outcome.timed_out
        else None
    )
    exits, terminated = failures.launcher_exits(job_dir), failures.terminated_ranks(job_dir, spec.tp)
    ended_well = ended is not None and all(r and r.get("status") == "ok" for r in ranks)
    failure = failures.classify(
        outcome.timed_out,
        0 if ended_well else outcome.returncode,  # a rank that ran out of memory alone ended them: a result
        ranks,
        tails,
        exits=exits,
        hangs=hangs,
        terminated=terminated,
        oom_killed=(result["teardown"].get("oom_kills") or 0) > (base.get("oom_kills") or 0),
    )
    illegal_instruction.name(failure, job_dir, ranks, exits, spec.script.path)  # a rank killed by SIGILL
    failures.record_how_ranks_ended(
        ranks, failure, {**exits, **{r: -signal.SIGTERM for r in terminated}}, outcome.returncode
    )
    if failure is None and spec.workload == "script":
        result["no_engine_call"] = script_job.no_engine_call(spec, ranks)  # ran well, but nothing was sharded
    if failure is None:
        result["correctness"] = (
            script_job.check_output(spec, job_dir, runtime, ref)
            if spec.workload == "script"
            else correctness.check_output(spec, job_dir, ranks, ref)
        )
        if result["correctness"] and not result["correctness"]["passed"]:
            c = result["correctness"]
            failure = {
                "cause": "incorrect_output",
                "rank": 0,
                "phase": "generate",
                "message": incorrect_output_message(c, ranks),
            }
    if failure is not None and failure["cause"] == "load_error":
        problem = checkpoint_problem(Path(runtime["model_dir"]))  # changed since the check before launch?
        failure["message"] += f" ({problem})" if problem else ""
    if failure is not None:
        failure["memory_reached"] = failures.memory_reached(ranks)
        failure["log_tails"] = tails
    result["failure"] = failure
    result["status"] = "ok" if failure is None else "failed"
