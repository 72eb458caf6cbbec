"""The contract between a job and its ranks: the files they exchange and the signals they agree on.

The job writes `<job_dir>/job.json` (the resolved config and the runtime facts it prepared) and starts
`python -m dsexp.rank.worker <job_dir>` on every rank; each rank writes `ranks/rank{N}.json` after every
phase, a heartbeat `ranks/rank{N}.live.json`, its log, and (rank 0) the first-step logits.
"""

from __future__ import annotations

import signal
from dataclasses import asdict
from pathlib import Path
from typing import Any, Dict, Tuple

from dsexp.core.fs import read_json, write_json_atomic
from dsexp.core.schema import JobConfig, from_dict

WORKER_MODULE = "dsexp.rank.worker"
TOKEN_ENV = "DSEXP_JOB_TOKEN"  # every process of a job carries it (teardown finds survivors by it)
STACK_SIGNAL = signal.SIGUSR1  # the worker dumps every thread's stack on it (faulthandler)
STACK_IMPORT_ERROR = "StackImportError"  # the error type a rank records when its software stack fails to import
SCRIPT_JOB_ENV = "DSEXP_SCRIPT_JOB"  # a user's script's ranks: the job folder (dsexp.rank.bootstrap turns on)
SCRIPT_ENV = "DSEXP_SCRIPT"  # ... and the script's path (only the process running it is a rank to measure)
SCRIPT_ENTRY_MODULE = "dsexp.rank.workloads.script.entry"  # what the launcher runs on a script's ranks
SHARED_GPUS_ENV = "DSEXP_SHARED_GPUS"  # ranks sharing GPUs: the GPUs (CUDA indices as the job saw them) they share
CAMPAIGN_ENV = "DSEXP_CAMPAIGN"  # set by python -m dsexp.campaign: the campaign a job ran in (result.json "campaign")
COMMIT_ENV = "DSEXP_COMMIT"  # ... and the dsexp commit it ran at (result.json "commit"; else read from git here)
OOM_ENDED_EXIT = 75  # a rank ended the job's ranks after running out of memory alone (dsexp.rank.oom_agreement)
RESULT = "result.json"
JOB_FILE = "job.json"


def write_job_file(job_dir: Path, spec: JobConfig, runtime: Dict[str, Any]) -> None:
    write_json_atomic(Path(job_dir) / JOB_FILE, {"config": asdict(spec), "runtime": runtime})


def read_job_file(job_dir: Path) -> Tuple[JobConfig, Dict[str, Any]]:
    job = read_json(Path(job_dir) / JOB_FILE)
    if job is None:
        raise FileNotFoundError(f"{Path(job_dir) / JOB_FILE} is missing or unreadable")
    return from_dict(JobConfig, job["config"]), job["runtime"]


def rank_file(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / "ranks" / f"rank{rank}.json"


def live_file(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / "ranks" / f"rank{rank}.live.json"


def rank_log(job_dir: Path, rank: int) -> Path:
    return Path(job_dir) / "ranks" / f"rank{rank}.log"


def bootstrap_dir() -> Path:
    """The folder holding dsexp's sitecustomize (put first on a script's ranks' PYTHONPATH)."""
    return Path(__file__).resolve().parents[1] / "rank" / "bootstrap"


def logits_file(job_dir: Path) -> Path:
    return Path(job_dir) / "ranks" / "logits_rank0.pt"
