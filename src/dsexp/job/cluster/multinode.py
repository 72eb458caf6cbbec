"""Jobs that span nodes (`launcher.nodes > 1`): where the ranks run and the command that starts them.

The Hydra job runs once, on the first node of the allocation, and starts every rank from there:

- `launcher=torchrun`: `srun --overlap` starts one `torchrun` per node; torchrun's c10d rendezvous
  (endpoint on the first node, where this process runs) numbers the nodes and ranks. Needs a SLURM
  allocation, nothing else (no ssh); SLURM binds the GPUs and reaps every process of the step.
- `launcher=deepspeed`: DeepSpeed's own multi-node runner (pdsh over ssh by default) with a hostfile,
  either `launcher.hostfile` or one written from the SLURM allocation. Our rank environment travels to
  the other nodes through `.deepspeed_env` in the job folder (the runner's cwd), which the runner exports.

Each node runs `tp / nodes` ranks. Everything is an argument list; nothing goes through a shell.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional

from dsexp.core.protocol import WORKER_MODULE
from dsexp.core.schema import JobConfig


def is_first_task() -> bool:
    """False in the extra tasks submitit starts on the other nodes of a multi-node job (they leave it to task 0)."""
    if "SUBMITIT_EXECUTOR" not in os.environ:
        return True
    import submitit

    return submitit.JobEnvironment().global_rank == 0


def slurm_hosts() -> List[str]:
    """The nodes of this SLURM allocation, in order (the first is the batch host, where this job runs)."""
    nodelist = os.environ.get("SLURM_JOB_NODELIST") or os.environ.get("SLURM_NODELIST")
    if not nodelist:
        raise RuntimeError(
            "launcher.nodes > 1 needs a SLURM allocation (SLURM_JOB_NODELIST is not set); "
            "run through hydra/launcher=dsexp_slurm, sbatch or salloc, or give launcher.hostfile "
            "with launcher=deepspeed"
        )
    out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, check=True)
    return out.stdout.split()


def node_address(node: str) -> str:
    """An address other nodes can reach `node` at: its name if that resolves, else SLURM's NodeAddr for it
    (NodeName need not be a hostname: e.g. several slurmd on one machine, `NodeName=n1 NodeAddr=127.0.0.1`)."""
    import socket

    try:
        socket.getaddrinfo(node, None)
        return node
    except OSError:
        pass
    try:
        out = subprocess.run(["scontrol", "show", "node", "-o", node], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return node
    for field in out.stdout.split() if out.returncode == 0 else []:
        if field.startswith("NodeAddr=") and field[len("NodeAddr=") :]:
            return field[len("NodeAddr=") :]
    return node


def single_machine(hosts: List[str]) -> bool:
    """Whether every node of the allocation is this one machine (several slurmd on one host, or fake nodes):
    their addresses all resolve to one IP."""
    import socket

    ips = set()
    for host in hosts:
        try:
            ips.add(socket.getaddrinfo(node_address(host), None, socket.AF_INET)[0][4][0])
        except OSError:
            return False
    return len(ips) == 1


def hostfile_hosts(path: Path) -> Dict[str, int]:
    """{host: slots} of a DeepSpeed hostfile, parsed by DeepSpeed itself."""
    from deepspeed.launcher.runner import fetch_hostfile

    pool = fetch_hostfile(str(path))
    if not pool:
        raise RuntimeError(f"hostfile {path} is missing or empty")
    return dict(pool)


def write_hostfile(path: Path, hosts: List[str], slots: int) -> Path:
    path.write_text("".join(f"{h} slots={slots}\n" for h in hosts))
    return path


def torchrun_command(
    spec: JobConfig,
    job_dir: Path,
    hosts: List[str],
    port: int,
    cpus_per_node: Optional[int] = None,
    target: Optional[List[str]] = None,
) -> List[str]:
    """srun: one torchrun per node (--overlap: the job's own step, e.g. submitit's, still holds the nodes)."""
    nodes = spec.launcher.nodes
    srun = ["srun", "--overlap", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1"]
    if cpus_per_node:  # else srun gives the task one CPU, and every rank of the node would share it
        srun.append(f"--cpus-per-task={cpus_per_node}")
    return [
        *srun,
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nnodes={nodes}",
        f"--nproc-per-node={spec.ranks_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={node_address(hosts[0])}:{port}",
        f"--rdzv-id=dsexp-{Path(job_dir).name}-{port}",
        *(target or ["-m", WORKER_MODULE, str(job_dir)]),
    ]


def deepspeed_command(
    spec: JobConfig, job_dir: Path, hostfile: Path, master: str, port: int, target: Optional[List[str]] = None
) -> List[str]:
    return [
        sys.executable,
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--num_nodes",
        str(spec.launcher.nodes),
        "--num_gpus",
        str(spec.ranks_per_node),
        "--master_addr",
        master,
        "--master_port",
        str(port),
        *(target or ["--no_local_rank", "--module", WORKER_MODULE, str(job_dir)]),
    ]


def rank_command(
    spec: JobConfig, job_dir: Path, port: int, env: Dict[str, str], target: Optional[List[str]] = None
) -> List[str]:
    """The command that starts all ranks of a multi-node job from this (the first) node; `target`: what each rank
    runs after the launcher's options (dsexp.job.launch.rank_target; default: the worker)."""
    job_dir = Path(job_dir)
    if spec.launcher.name == "deepspeed":
        hostfile = (
            Path(spec.launcher.hostfile).expanduser()
            if spec.launcher.hostfile
            else write_hostfile(job_dir / "hostfile", slurm_hosts(), spec.ranks_per_node)
        )
        hosts = list(hostfile_hosts(hostfile))
        (job_dir / ".deepspeed_env").write_text("".join(f"{k}={v}\n" for k, v in sorted(env.items())))
        return deepspeed_command(spec, job_dir, hostfile, hosts[0], port, target)
    cpus = os.environ.get("SLURM_CPUS_ON_NODE")
    return torchrun_command(spec, job_dir, slurm_hosts(), port, int(cpus) if cpus else None, target)
