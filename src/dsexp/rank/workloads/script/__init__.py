"""The script workload: a user's own inference script, run as written on every rank, measured per phase.

dsexp.rank.bootstrap (a sitecustomize the job puts first on the ranks' PYTHONPATH) calls `start()` in each rank
before the script's first line: the rank is mapped onto its GPU where ranks share one, its output goes to its log,
a PhaseRecorder starts (the same probes and rank file as dsexp's own jobs), and hooks patch the library calls the
script will make (hooks.py), each a phase with its facts (facts.py); the remedies `script.fix` asks for act through
the same hooks (fixes.py). The record is written after every phase and completed when the interpreter exits.
"""

from __future__ import annotations

import atexit
import builtins
import os
import sys
import time

from dsexp.core.protocol import SCRIPT_JOB_ENV, rank_log, read_job_file


def start() -> None:
    from pathlib import Path

    import dsexp.rank.workloads.script.hooks as hooks
    from dsexp.rank.output import redirect_output
    from dsexp.rank.probes.phases import PhaseRecorder
    from dsexp.rank.probes.snapshots import snapshot_options
    from dsexp.rank.shared_gpu import setup_rank
    from dsexp.rank.shm_fallback import note_fallback
    from dsexp.rank.workloads.script.session import ScriptSession

    t_process = _process_start()
    job_dir = Path(os.environ[SCRIPT_JOB_ENV])
    shared = setup_rank(sys.argv)  # before CUDA is used: this rank sees only its GPU
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    redirect_output(rank_log(job_dir, rank))
    spec, runtime = read_job_file(job_dir)
    rec = PhaseRecorder(
        job_dir, rank, world, local_rank, t_process, spec.probe.sample_ms, see_memory_usage=False,
        nvidia_smi=spec.probe.nvidia_smi, memory_snapshot=snapshot_options(spec.probe),
    )  # fmt: skip
    rec.note(workload="script", argv=list(sys.argv), **({"shared_gpu": shared} if shared else {}))
    note_fallback(rec)  # before the script's init_distributed: a CPU without avx512bw
    session = ScriptSession(rec, spec, runtime, rank, local_rank)
    if spec.script.fix:
        from dsexp.rank.workloads.script.fixes import Fixes

        session.fixes = Fixes(session, list(spec.script.fix))
    session.open_start(t_process)
    hooks.install(session, shared_gpu=bool(shared))
    _watch_the_end(session)


def _process_start() -> float:
    """The process's creation on the perf_counter clock (the start phase runs from there)."""
    from dsexp.rank.probes.host import process_started

    return time.perf_counter() - (time.time() - process_started())


def _watch_the_end(session) -> None:
    """Record how the script ends: an uncaught exception, sys.exit's code, or a normal end (atexit)."""
    previous_hook = sys.excepthook

    def excepthook(exc_type, exc, tb):
        session.uncaught(exc_type, exc, tb)
        previous_hook(exc_type, exc, tb)

    sys.excepthook = excepthook
    real_exit = sys.exit

    def exit(code=None):
        session.exit_code = code
        real_exit(code)

    sys.exit = exit
    for name in ("exit", "quit"):
        if hasattr(builtins, name):
            setattr(builtins, name, exit)
    atexit.register(session.finish)
