"""Spawn a job's ranks with torchrun or the DeepSpeed launcher, in their own process group, with a timeout.

Ranks never run Hydra: the launcher runs `python -m dsexp.rank.worker <job_dir>`. Everything is started
from an argument list (no shell). On timeout, failure or interruption the whole process group is
killed, so no rank outlives its job holding memory.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.core.protocol import (
    SCRIPT_ENTRY_MODULE,
    SCRIPT_ENV,
    SCRIPT_JOB_ENV,
    SHARED_GPUS_ENV,
    TOKEN_ENV,
    WORKER_MODULE,
    bootstrap_dir,
)
from dsexp.core.schema import JobConfig
from dsexp.job import overlay, teardown
from dsexp.job.cluster import multinode
from dsexp.trims.env import env_value


@dataclass
class LaunchOutcome:
    cmd: List[str]
    returncode: Optional[int]
    timed_out: bool
    wall_s: float
    port: Optional[int] = None
    env: Dict[str, str] = field(default_factory=dict)
    teardown: Dict[str, object] = field(default_factory=dict)  # survivors reaped, ports released, stacks dumped
    clock: Dict[str, float] = field(
        default_factory=dict
    )  # epoch seconds: popen, exited (launcher gone), done (torn down)

    def to_dict(self) -> dict:
        return asdict(self)


def free_port() -> int:
    """A port the OS just handed out and released (for launchers that need one up front)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_target(spec: JobConfig, job_dir: Path, script: Optional[Dict[str, Any]] = None) -> List[str]:
    """What the launcher starts on every rank, after its own options: dsexp's worker for this job, or (`script`: the
    job's runtime facts of a user's script) dsexp's entry for it, which reads the script and its arguments from the
    job file: the launcher's argparse never sees them (it would take `--n` for its --nnodes). The DeepSpeed launcher
    passes --local_rank=N on to the script unless script.local_rank_arg=false; the worker never takes it."""
    deepspeed = spec.launcher.name == "deepspeed"
    module = WORKER_MODULE if script is None else SCRIPT_ENTRY_MODULE
    if not deepspeed:
        return ["-m", module, str(job_dir)]
    local_rank = [] if (script is not None and spec.script.local_rank_arg) else ["--no_local_rank"]
    return [*local_rank, "--module", module, str(job_dir)]


def rank_command(
    spec: JobConfig, job_dir: Path, port: Optional[int], script: Optional[Dict[str, Any]] = None
) -> List[str]:
    target = rank_target(spec, job_dir, script)
    if spec.launcher.name == "deepspeed":
        gpus = ["--num_gpus", str(spec.tp)]
        return [sys.executable, "-m", "deepspeed.launcher.runner", "--master_port", str(port), *gpus, *target]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={spec.tp}",
        *target,
    ]


def rank_env(
    spec: JobConfig,
    device: str,
    visible: Optional[str] = None,
    stack: Optional[Dict[str, Any]] = None,
    job_dir: Optional[Path] = None,
) -> Dict[str, str]:
    """Environment the ranks need on top of ours (only these keys are recorded); `stack`: the prepared software
    stack (dsexp.job.overlay), whose overlay and extension folder the ranks use; `trim.env` last. A script's ranks
    get dsexp's bootstrap first on PYTHONPATH (ahead of a stack's overlay) and the job folder it records into."""
    local = spec.ranks_per_node  # ranks on this node
    threads = max(1, len(os.sched_getaffinity(0)) // local)  # the CPUs this job may use (a SLURM job: its share)
    env = {
        "PYTHONUNBUFFERED": "1",
        "OMP_NUM_THREADS": str(threads),
        "NCCL_NVLS_ENABLE": "0",
        "TOKENIZERS_PARALLELISM": "false",
    }
    if device == "cpu":
        # DeepSpeed's CPU accelerator; its shared-memory all-reduce needs LOCAL_SIZE under torchrun: the ranks
        # sharing this host's memory, which are all of them when every "node" is this machine
        env.update(DS_ACCELERATOR="cpu", LOCAL_SIZE=str(_ranks_on_this_host(spec)), CUDA_VISIBLE_DEVICES="")
    else:
        env["DS_ACCELERATOR"] = "cuda"
        if visible is not None:
            env["CUDA_VISIBLE_DEVICES"] = visible
        if spec.shared_gpu:  # each rank maps itself onto one of these (dsexp.rank.shared_gpu)
            env.update(shared_env(int(spec.launcher.gpus), visible or os.environ.get("CUDA_VISIBLE_DEVICES")))
    env.update(overlay.rank_env(stack))
    if spec.workload == "script":
        rest = env.get("PYTHONPATH") or os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(bootstrap_dir()), rest) if p)
        env.update({SCRIPT_JOB_ENV: str(job_dir), SCRIPT_ENV: str(spec.script.path)})
    env.update({k: env_value(v) for k, v in (spec.trim.env or {}).items()})  # validated: dsexp.trims.env
    return env


def shared_env(gpus: int, visible: Optional[str]) -> Dict[str, str]:
    """Ranks sharing GPUs: the variable that tells each rank which GPUs the ranks share (the first `gpus` of the
    visible ones: CUDA_VISIBLE_DEVICES' entries, or 0..gpus-1); each rank takes one round-robin."""
    pool = [v.strip() for v in visible.split(",") if v.strip()] if visible else [str(i) for i in range(gpus)]
    return {SHARED_GPUS_ENV: ",".join(pool[:gpus])}


def _ranks_on_this_host(spec: JobConfig) -> int:
    """Ranks on this machine: ranks_per_node, or all tp ranks when the job's nodes are one machine (two slurmd
    on one host). DeepSpeed 0.19.8's CPU shared-memory all-reduce is used only when LOCAL_SIZE is the world
    size, and crashes (SIGSEGV) on ranks spread over hosts: it has no fallback to gloo then."""
    if spec.launcher.nodes > 1 and spec.launcher.name == "torchrun":
        try:
            if multinode.single_machine(multinode.slurm_hosts()):
                return spec.tp
        except (RuntimeError, OSError, subprocess.SubprocessError):
            pass
    return spec.ranks_per_node


def kill_group(pgid: int, grace_s: float, leader: Optional[subprocess.Popen] = None) -> None:
    """SIGTERM the group, wait up to grace_s for it to go, then SIGKILL whatever is left.

    `leader` (our child that leads the group) is reaped while waiting: as a zombie it would keep the group alive."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(pgid, sig)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline:
            if leader is not None:
                leader.poll()
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)


def run_ranks(
    spec: JobConfig,
    job_dir: Path,
    device: str,
    visible: Optional[str] = None,
    stack: Optional[Dict[str, Any]] = None,
    script: Optional[Dict[str, Any]] = None,
    timeout_s: Optional[float] = None,
) -> LaunchOutcome:
    """Start the job's ranks (dsexp's worker, or `script`: the user's script as the job prepared it) and wait, at most
    `timeout_s` (default: the job's timeout_s; a relaunch gets what the job has left)."""
    nodes = spec.launcher.nodes
    port = free_port() if spec.launcher.name == "deepspeed" or nodes > 1 else None
    extra = rank_env(spec, device, visible, stack, job_dir)
    if nodes > 1:
        cmd = multinode.rank_command(spec, job_dir, port, extra, rank_target(spec, job_dir, script))
    else:
        cmd = rank_command(spec, job_dir, port, script)
    token = teardown.new_token()
    env = {**os.environ, **extra, TOKEN_ENV: token}
    log = open(Path(job_dir) / "launcher.log", "ab")
    t0, popen = time.perf_counter(), time.time()
    cwd = script["cwd"] if script else str(job_dir)  # a script runs where the user launched dsexp
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True, cwd=cwd)
    timed_out, report = False, {"token": token}
    try:
        proc.wait(timeout=spec.timeout_s if timeout_s is None else timeout_s)
        exited = time.time()
    except subprocess.TimeoutExpired:
        exited = None
        timed_out = True
        procs = teardown.job_processes(token)  # one scan of the process table for both
        report["stacks_dumped"] = teardown.dump_stacks(procs)
        report["ports"] = teardown.listening_ports(procs)
    finally:
        # Also after a clean exit: a rank that daemonised or a stuck grandchild must not survive the job.
        kill_group(proc.pid, spec.launcher.grace_s, leader=proc)
        proc.wait()
        report.update(teardown.reap(token, spec.launcher.grace_s, report.get("ports", []) + ([port] if port else [])))
        report["shm_removed"] = teardown.release_shm(job_dir)
        log.close()
    return LaunchOutcome(
        cmd,
        None if timed_out else proc.returncode,
        timed_out,
        time.perf_counter() - t0,
        port,
        extra,
        report,
        {"popen": popen, "exited": exited, "done": time.time()},
    )
