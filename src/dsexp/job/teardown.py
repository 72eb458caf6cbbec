"""Leave nothing behind: find a job's processes wherever they went, stop them, and check what they held.

Launchers put ranks in sessions of their own (torchrun starts every worker with `start_new_session`),
so killing the launcher's process group can orphan ranks. Every process of a job therefore carries
`DSEXP_JOB_TOKEN=<token>` in its environment (inherited from the launcher); after the launcher is
gone, any process still carrying the token is a survivor and is stopped here. On a hang, the ranks
are first asked to dump their Python stacks into their logs (faulthandler on SIGUSR1). Finally the
shared-memory segments DeepSpeed's CPU all-reduce leaves in /dev/shm are removed.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Dict, List, Optional

import psutil

from dsexp.core.fs import read_json
from dsexp.core.protocol import SCRIPT_JOB_ENV, STACK_SIGNAL, TOKEN_ENV, WORKER_MODULE

GPU_TOLERANCE = 64 * 2**20  # device memory within this of the baseline counts as released
SHM_DIR = "/dev/shm"


def new_token() -> str:
    return uuid.uuid4().hex


def job_processes(token: str) -> List[psutil.Process]:
    """Live (non-zombie) processes whose environment carries this job's token, other than us."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and p.status() != psutil.STATUS_ZOMBIE and p.environ().get(TOKEN_ENV) == token:
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def dump_stacks(procs: List[psutil.Process], wait_s: float = 1.0) -> int:
    """Ask every rank among the job's processes to write its Python stacks to its log (before it is killed
    for hanging). Only ranks get the signal (launchers set LOCAL_RANK for them): SIGUSR1 would kill a launcher."""
    ranks = []
    for p in procs:
        try:
            env = p.environ()
            if "LOCAL_RANK" in env and (WORKER_MODULE in p.cmdline() or SCRIPT_JOB_ENV in env):
                p.send_signal(STACK_SIGNAL)
                ranks.append(p)
        except psutil.Error:
            continue
    if ranks:
        time.sleep(wait_s)
    return len(ranks)


def reap_stale(job_dir: Path, grace_s: float = 5.0) -> List[str]:
    """Ranks and launchers of an earlier attempt of this job that outlived it (its job process was killed
    outright, so its own teardown never ran): any process running the worker for this job folder."""
    target = str(job_dir)
    stale = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmd = p.info["cmdline"] or []
        if p.pid == os.getpid():
            continue
        if (target in cmd and any(WORKER_MODULE in part for part in cmd)) or _script_rank_of(p, target):
            stale.append(p)
    names = [f"{p.pid}:{p.info['cmdline'][0]}" for p in stale]
    _stop(stale, grace_s)
    return names


def _script_rank_of(p: psutil.Process, job_dir: str) -> bool:
    """A user's script's rank (or its launcher) started for this job folder (dsexp.job.script_job)."""
    try:
        return p.environ().get(SCRIPT_JOB_ENV) == job_dir
    except psutil.Error:
        return False


def _stop(procs: List[psutil.Process], grace_s: float) -> List[psutil.Process]:
    """SIGTERM each, SIGKILL those still alive after grace_s; returns the ones that got SIGKILL."""
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.terminate()
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            p.kill()
    return alive


def listening_ports(procs: List[psutil.Process]) -> List[int]:
    ports = set()
    for p in procs:
        try:
            ports.update(c.laddr.port for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN)
        except psutil.Error:
            continue
    return sorted(ports)


def port_free(port: int) -> bool:
    """True if nothing listens on the port (TIME_WAIT leftovers do not count: SO_REUSEADDR, as servers use)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def reap(token: str, grace_s: float, ports: Optional[List[int]] = None) -> Dict[str, Any]:
    """SIGTERM every survivor of the job, SIGKILL what is left after grace_s; report what was found."""
    procs = job_processes(token)
    ports = sorted(set(ports or []) | set(listening_ports(procs)))
    survivors = []
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):
            survivors.append(f"{p.pid}:{p.name()}")
    _, alive = psutil.wait_procs(_stop(procs, grace_s), timeout=5.0)
    return {
        "survivors": survivors,
        "killed": len(alive) == 0 and bool(survivors),
        "left": [p.pid for p in alive],
        "ports": {str(port): port_free(port) for port in ports},
    }


def release_shm(job_dir: Path) -> List[str]:
    """Remove the job's DeepSpeed CPU all-reduce segments
    (/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>, 64 MiB a rank). DeepSpeed never unlinks them,
    so without this every CPU job leaks host memory until reboot."""
    removed = []
    for rec_file in Path(job_dir).glob("ranks/rank*.json"):
        master = (read_json(rec_file) or {}).get("master", "")
        addr, _, port = master.rpartition(":")
        if not addr or not port.isdigit():
            continue
        for seg in Path(SHM_DIR).glob(f"deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_*"):
            with contextlib.suppress(FileNotFoundError):
                seg.unlink()
                removed.append(seg.name)
    return sorted(removed)


def gpu_used(indices: Optional[List[int]] = None) -> Optional[List[int]]:
    """Used bytes per physical GPU (NVML; only `indices` if given: a packed job's own), or None without a driver."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [
                int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).used)
                for i in (range(pynvml.nvmlDeviceGetCount()) if indices is None else indices)
            ]
        finally:
            pynvml.nvmlShutdown()
    except Exception:
        return None


def wait_gpu_baseline(
    before: Optional[List[int]], timeout_s: float = 30.0, indices: Optional[List[int]] = None
) -> Dict[str, Any]:
    """Wait until every GPU (of `indices`, if given) is back within GPU_TOLERANCE of its pre-job usage (the driver
    frees a dead process's memory asynchronously); record the figures either way."""
    t0 = time.monotonic()
    after = gpu_used(indices)
    while after is not None and before is not None and time.monotonic() - t0 < timeout_s:
        if all(a <= b + GPU_TOLERANCE for a, b in zip(after, before)):
            break
        time.sleep(0.5)
        after = gpu_used(indices)
    back = None if after is None or before is None else all(a <= b + GPU_TOLERANCE for a, b in zip(after, before))
    return {
        "gpu_used_before": before,
        "gpu_used_after": after,
        "gpu_back_to_baseline": back,
        "gpu_wait_s": round(time.monotonic() - t0, 2),
    }
