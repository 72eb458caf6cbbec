#!/usr/bin/env python3
"""A throwaway SLURM cluster on this machine: munged, slurmctld and one or two slurmd, all from one folder.

    python3 tests/helpers/slurm_cluster.py start [--dir D] [--nodes 1|2]   # prints the `export SLURM_CONF=...` line
    python3 tests/helpers/slurm_cluster.py status [--dir D]
    python3 tests/helpers/slurm_cluster.py stop [--dir D]

or from Python (the test fixture does this):

    with start_cluster(tmpdir, nodes=1) as cluster:
        subprocess.run(["sbatch", "--wrap", "hostname"], env=cluster.env)
        cluster.final_state(job_id)

Needs Debian's `slurm-wlm` and `munge` (.ci/install-slurm.sh) and root: slurmd runs jobs as their user.
Everything lives under the folder: slurm.conf, the munge key and socket, state/spool/log dirs, pid files,
the job-completion file and `cluster.json` (the PIDs started, with their start times). `stop` cancels
the cluster's jobs, kills exactly the recorded PIDs (checked against their start times, so a reused PID
is never hit), then any slurmstepd this cluster's slurmd left behind, and removes what `start` created.

Clients find the cluster through SLURM_CONF (read by sbatch, squeue, sinfo, scancel, scontrol, srun): see
`Cluster.env`. No slurmdbd runs, so the real `sacct` has nothing to read; finished jobs stay visible to
`scontrol show job` for MinJobAge seconds and are written for good to the jobcomp/filetxt file, which
`final_state()` / `job_record()` read. `Cluster.env` also puts `<dir>/bin` first on PATH, where a small
`sacct` answers submitit's `sacct -o JobID,State,NodeList --parsable2 -j ID` from those two sources
(start with --no-sacct to leave the real one).

Test infrastructure (the fixtures in tests/helpers/slurm.py, `make slurm-up`, benchmarks/slurm.py and
benchmarks/slurm_probe.py use it). Standard library only: this file must not import dsexp.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional

DEFAULT_DIR = Path(os.environ.get("DSEXP_SLURM_DIR") or Path(tempfile.gettempdir()) / "dsexp-slurm")
DEFAULT_PORT = 16817  # slurmctld; slurmd n1, n2 on the next ones (SLURM's defaults are 6817/6818)
CLUSTER_NAME = "dsexp"
PARTITION = "debug"
STATE_FILE = "cluster.json"
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scancel", "scontrol", "srun")
TERMINAL_STATES = {
    "BOOT_FAIL",
    "CANCELLED",
    "COMPLETED",
    "DEADLINE",
    "FAILED",
    "NODE_FAIL",
    "OUT_OF_MEMORY",
    "PREEMPTED",
    "TIMEOUT",
    "REVOKED",
    "SPECIAL_EXIT",
}
# the timing knobs the fault tests depend on (the rest are SLURM's defaults; see docs/notes-slurm.md)
DEFAULT_TIMING = {
    "KillWait": 10,  # seconds between SIGTERM and SIGKILL at a time limit / scancel (default 30)
    "MinJobAge": 3600,  # keep a finished job in `scontrol show job` for an hour (default 300)
    "SlurmdTimeout": 30,  # a silent slurmd is marked DOWN after this (default 300)
    "MessageTimeout": 10,
    "OverTimeLimit": 0,
    "InactiveLimit": 0,
    "ReturnToService": 1,  # a node DOWN for not responding comes back when its slurmd does; `scontrol update
    # state=down` sticks until state=resume (2 would undo it at the next ping)
    "cred_expire": 20,  # AuthInfo: a requeued job waits this long before it may start again (default 120).
    # Tests that freeze a slurmd with a requeueable job on it want 120: with 20 the
    # rerun met the stale copy ("Duplicate jobid", node DRAIN; docs/notes-slurm.md §5)
    "SchedulerParameters": "sched_interval=5,bf_interval=5",  # start a requeued job ~1 s after that, not 15-30 s
}


class ClusterError(RuntimeError):
    pass


# ----------------------------------------------------------------------------------------------- helpers


def which(name: str) -> Optional[str]:
    return shutil.which(name) or next(
        (p for p in (f"/usr/sbin/{name}", f"/usr/bin/{name}") if os.access(p, os.X_OK)), None
    )


def missing_binaries() -> List[str]:
    return [b for b in BINARIES if which(b) is None]


def _proc_start(pid: int) -> Optional[int]:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22), None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):  # a zombie has exited already
        return None
    return int(fields[19])


def _alive(pid: int, start: Optional[int]) -> bool:
    now = _proc_start(pid)
    return now is not None and (start is None or now == start)


def _port_taken(port: int) -> bool:
    for family, addr in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET, "127.0.0.1")):
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a TIME_WAIT left by a previous run is fine
            try:
                s.bind((addr, port))
            except OSError:
                return True
    return False


def _tail(path: Path, n: int = 25) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return f"  ({path}: missing)"
    return "\n".join(f"  {line}" for line in lines[-n:]) or f"  ({path}: empty)"


def _detect_node() -> Dict[str, int]:
    """What slurmd sees here (`slurmd -C`): CPUs, sockets, cores, threads, RealMemory (MiB)."""
    out = subprocess.run([which("slurmd") or "slurmd", "-C"], capture_output=True, text=True, timeout=30).stdout
    vals = dict(re.findall(r"(\w+)=(\S+)", out.splitlines()[0] if out else ""))
    keys = ("CPUs", "Boards", "SocketsPerBoard", "CoresPerSocket", "ThreadsPerCore", "RealMemory")
    if not all(k in vals for k in keys):
        raise ClusterError(f"could not read `slurmd -C`: {out!r}")
    return {k: int(vals[k]) for k in keys}


def parse_record(line: str) -> Dict[str, str]:
    """`Key=value Key2=value two ...` (scontrol -o, jobcomp/filetxt) -> dict; a value runs to the next ` Key=`."""
    parts = re.split(r"\s+(?=[A-Za-z][A-Za-z0-9_:/]*=)", line.strip())
    return dict(p.split("=", 1) for p in parts if "=" in p)


# ----------------------------------------------------------------------------------------------- cluster


class Cluster:
    """A running (or described) cluster under `dir`: `env` points SLURM's clients at it."""

    def __init__(
        self, dir: Path, nodes: List[str], port: int, processes: Optional[List[dict]] = None, sacct_shim: bool = True
    ):
        self.dir = Path(dir).resolve()
        self.nodes = list(nodes)
        self.port = port
        self.processes = processes or []  # [{"name", "pid", "start", "cmd", "log"}]
        self.sacct_shim = sacct_shim
        self._popen: Dict[int, subprocess.Popen] = {}

    # paths
    @property
    def conf(self) -> Path:
        return self.dir / "slurm.conf"

    @property
    def jobcomp(self) -> Path:
        return self.dir / "jobcomp.txt"

    @property
    def munge_socket(self) -> Path:
        return self.dir / "munge" / "munge.socket.2"

    @property
    def env(self) -> Dict[str, str]:
        """os.environ plus what points SLURM's clients at this cluster (SLURM_CONF; PATH for the sacct shim)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
        env["SLURM_CONF"] = str(self.conf)
        if self.sacct_shim:
            env["PATH"] = f"{self.dir / 'bin'}{os.pathsep}{env.get('PATH', '')}"
        return env

    @property
    def env_vars(self) -> Dict[str, str]:
        """Only the variables that differ from os.environ (for `export` lines)."""
        out = {"SLURM_CONF": str(self.conf)}
        if self.sacct_shim:
            out["PATH"] = self.env["PATH"]
        return out

    # clients
    def run(self, *args: str, check: bool = True, timeout: float = 30) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(args), env=self.env, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise ClusterError(
                f"{' '.join(args)} failed ({proc.returncode}): {proc.stderr.strip() or proc.stdout.strip()}"
            )
        return proc

    def sbatch(self, *args: str) -> str:
        """Submit; returns the job id (`sbatch --parsable`)."""
        return self.run("sbatch", "--parsable", *args).stdout.strip().split(";")[0]

    def node_states(self) -> Dict[str, str]:
        proc = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False, timeout=15)
        if proc.returncode != 0:
            return {}
        return dict(line.split()[:2] for line in proc.stdout.splitlines() if len(line.split()) >= 2)

    def job_record(self, job_id: str) -> Optional[Dict[str, str]]:
        return job_record(job_id, self.dir)

    def job_records(self, job_id: str) -> List[Dict[str, str]]:
        return job_records(job_id, self.dir)

    def final_state(self, job_id: str) -> Optional[str]:
        return final_state(job_id, self.dir)

    def wait_final(self, job_id: str, timeout: float = 120, poll: float = 0.5) -> Dict[str, str]:
        """Wait (with a deadline) until the job has a final state; returns its record."""
        deadline = time.monotonic() + timeout
        while True:
            rec = self.job_record(job_id)
            if rec and rec.get("JobState") in TERMINAL_STATES:
                return rec
            if time.monotonic() > deadline:
                raise ClusterError(f"job {job_id} not finished after {timeout:.0f}s (last seen: {rec})")
            time.sleep(poll)

    # lifecycle
    def save(self) -> None:
        state = {
            "dir": str(self.dir),
            "nodes": self.nodes,
            "port": self.port,
            "processes": self.processes,
            "sacct_shim": self.sacct_shim,
            "conf": str(self.conf),
        }
        tmp = self.dir / (STATE_FILE + ".tmp")
        tmp.write_text(json.dumps(state, indent=1))
        tmp.replace(self.dir / STATE_FILE)

    @classmethod
    def load(cls, dir: Path) -> "Cluster":
        path = Path(dir) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ClusterError(f"no cluster recorded in {dir} ({path}: {e})") from None
        return cls(Path(state["dir"]), state["nodes"], state["port"], state["processes"], state.get("sacct_shim", True))

    def alive(self) -> Dict[str, bool]:
        return {p["name"]: _alive(p["pid"], p.get("start")) for p in self.processes}

    def stop(self, timeout: float = 20) -> List[str]:
        """Cancel the jobs, kill exactly the recorded daemons (TERM, then KILL), clean the folder. Returns a log."""
        log: List[str] = []
        ctld = next((p for p in self.processes if p["name"] == "slurmctld"), None)
        if ctld and _alive(ctld["pid"], ctld.get("start")):
            self._cancel_all(log, timeout=timeout)
        stepds_before = self._stepds()
        # slurmd first, then slurmctld, munged last (the others talk to it until they are gone)
        order = {"slurmd": 0, "slurmctld": 1, "munged": 2}
        for p in sorted(self.processes, key=lambda p: order.get(p["name"].split("-")[0], 9)):
            self._kill(p, log, timeout)
        for pid, start in {**stepds_before, **self._stepds()}.items():  # slurmstepd of jobs that would not die
            self._kill({"name": "slurmstepd", "pid": pid, "start": start}, log, 5, tree=True)
        self.processes = [p for p in self.processes if _alive(p["pid"], p.get("start"))]
        if self.processes:
            self.save()
            raise ClusterError(f"could not stop {self.processes}; {self.dir} kept")
        self._remove()
        log.append(f"removed {self.dir}")
        return log

    def __enter__(self) -> "Cluster":
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # internals
    def _cancel_all(self, log: List[str], timeout: float) -> None:
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if not jobs:
            return
        self.run("scancel", *jobs, check=False)
        log.append(f"cancelled jobs {' '.join(jobs)}")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
            time.sleep(0.5)

    def _stepds(self) -> Dict[int, Optional[int]]:
        """slurmstepd processes of this cluster (their environment carries our SLURM_CONF)."""
        found = {}
        needle = f"SLURM_CONF={self.conf}".encode()
        for d in Path("/proc").iterdir():
            if not d.name.isdigit():
                continue
            try:
                if (d / "comm").read_text().strip() != "slurmstepd":
                    continue
                if needle in (d / "environ").read_bytes().split(b"\0"):
                    found[int(d.name)] = _proc_start(int(d.name))
            except OSError:
                continue
        return found

    def _kill(self, p: dict, log: List[str], timeout: float, tree: bool = False) -> None:
        pid, start = p["pid"], p.get("start")
        if not _alive(pid, start):
            self._reap(pid)
            return
        victims = [pid] + (_descendants(pid) if tree else [])
        for sig in (signal.SIGTERM, signal.SIGKILL):
            for v in victims:
                try:
                    os.kill(v, sig)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + (timeout if sig == signal.SIGTERM else 5)
            while time.monotonic() < deadline and _alive(pid, start):
                self._reap(pid)
                time.sleep(0.1)
            if not _alive(pid, start):
                self._reap(pid)
                gone = time.monotonic() + 2  # a zombie is reaped by its parent (init, after a CLI start)
                while time.monotonic() < gone and Path(f"/proc/{pid}").exists():
                    time.sleep(0.1)
                log.append(f"stopped {p['name']} (pid {pid}, {sig.name})")
                return

    def _reap(self, pid: int) -> None:
        proc = self._popen.get(pid)
        if proc is not None:
            proc.poll()

    def _remove(self) -> None:
        created = [
            "slurm.conf",
            "munge",
            "state",
            "spool",
            "log",
            "run",
            "bin",
            "jobcomp.txt",
            STATE_FILE,
            STATE_FILE + ".tmp",
            "jobs",
        ]
        for name in created:
            path = self.dir / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            elif path.exists() or path.is_symlink():
                path.unlink()
        if (self.dir / ".created-by-slurm_cluster").exists():
            (self.dir / ".created-by-slurm_cluster").unlink()
            try:
                self.dir.rmdir()  # only if nothing else was put there
            except OSError:
                pass


def _descendants(pid: int) -> List[int]:
    children: Dict[int, List[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


# ----------------------------------------------------------------------------------------------- config


def write_config(cluster: Cluster, node: Dict[str, int], timing: Dict[str, int]) -> str:
    host = socket.gethostname().split(".")[0]
    d = cluster.dir
    hw = (
        f"CPUs={node['CPUs']} Boards={node['Boards']} SocketsPerBoard={node['SocketsPerBoard']} "
        f"CoresPerSocket={node['CoresPerSocket']} ThreadsPerCore={node['ThreadsPerCore']} "
        f"RealMemory={node['RealMemory']}"
    )
    lines = [
        "# written by tests/helpers/slurm_cluster.py: a throwaway cluster on this machine (its `stop` stops it)",
        f"ClusterName={CLUSTER_NAME}",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={cluster.port}",
        f"SlurmdPort={cluster.port + 1}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        f"AuthInfo=socket={cluster.munge_socket},cred_expire={timing['cred_expire']}",
        f"StateSaveLocation={d / 'state'}",
        f"SlurmdSpoolDir={d / 'spool' / '%n'}",
        f"SlurmctldPidFile={d / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={d / 'run' / 'slurmd-%n.pid'}",
        f"SlurmctldLogFile={d / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={d / 'log' / 'slurmd-%n.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        f"PlugStackConfig={d / 'plugstack.conf'}",  # not /etc/slurm's (the file need not exist)
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        f"DefMemPerCPU={node['RealMemory'] // node['CPUs']}",
        "SchedulerType=sched/backfill",
        "MpiDefault=none",
        "SwitchType=switch/none",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/filetxt",
        f"JobCompLoc={cluster.jobcomp}",
        "MailProg=/bin/true",
        "EnforcePartLimits=ALL",  # refuse at submit what no node/partition can ever run (else it pends forever)
        *(f"{k}={v}" for k, v in timing.items() if k != "cred_expire"),
    ]
    for i, name in enumerate(cluster.nodes):
        lines.append(
            f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={cluster.port + 1 + i} {hw} State=UNKNOWN"
        )
    lines.append(f"PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
    text = "\n".join(lines) + "\n"
    cluster.conf.write_text(text)
    return text


def _write_sacct_shim(cluster: Cluster) -> None:
    bindir = cluster.dir / "bin"
    bindir.mkdir(exist_ok=True)
    shim = bindir / "sacct"
    shim.write_text(
        "#!/bin/sh\n# sacct for a cluster without slurmdbd: answers from scontrol and the jobcomp file\n"
        f"exec {shlex.quote(sys.executable)} {shlex.quote(str(Path(__file__).resolve()))} "
        f'sacct --dir {shlex.quote(str(cluster.dir))} "$@"\n'
    )
    shim.chmod(0o755)


# ----------------------------------------------------------------------------------------------- start


def start_cluster(
    dir: Optional[os.PathLike] = None,
    nodes: int = 1,
    port: int = DEFAULT_PORT,
    timeout: float = 60,
    timing: Optional[Dict[str, int]] = None,
    sacct_shim: bool = True,
) -> Cluster:
    """Write the config under `dir`, start munged, slurmctld and `nodes` slurmd, wait until sinfo shows
    every node idle. Returns the Cluster (a context manager: leaving it stops everything)."""
    if nodes not in (1, 2):
        raise ClusterError(f"nodes must be 1 or 2, not {nodes}")
    if os.geteuid() != 0:
        raise ClusterError("must run as root (slurmd runs jobs as their user; munged and slurmctld run as root here)")
    missing = missing_binaries()
    if missing:
        raise ClusterError(f"missing SLURM/munge binaries: {' '.join(missing)} (run .ci/install-slurm.sh)")
    dir = Path(dir or DEFAULT_DIR)
    if (dir / STATE_FILE).exists():
        old = Cluster.load(dir)
        if any(old.alive().values()):
            raise ClusterError(f"a cluster is already running from {dir} ({old.alive()}): stop it first")
        old._remove()
    taken = [p for p in range(port, port + 1 + nodes) if _port_taken(p)]
    if taken:
        raise ClusterError(
            f"port(s) {taken} already in use (another slurmctld/slurmd?): "
            f"stop it or pass another --port (this cluster needs {port}..{port + nodes})"
        )
    fresh = not dir.exists()
    dir.mkdir(parents=True, exist_ok=True)
    if fresh:
        (dir / ".created-by-slurm_cluster").touch()
    dir.chmod(0o755)
    cluster = Cluster(dir, [f"n{i + 1}" for i in range(nodes)], port, sacct_shim=sacct_shim)
    try:
        _start(cluster, {**DEFAULT_TIMING, **(timing or {})}, timeout)
    except BaseException:
        try:
            cluster.stop(timeout=5)
        except Exception:
            pass
        raise
    return cluster


def _start(cluster: Cluster, timing: Dict[str, int], timeout: float) -> None:
    d = cluster.dir
    for sub in ("munge", "state", "spool", "log", "run"):
        (d / sub).mkdir(exist_ok=True)
    (d / "munge").chmod(0o755)  # munged wants x for all on the socket dir (jobs of any user); the key is 0600
    for name in cluster.nodes:
        (d / "spool" / name).mkdir(exist_ok=True)
    key = d / "munge" / "munge.key"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secrets.token_bytes(1024))
    write_config(cluster, _detect_node(), timing)
    if cluster.sacct_shim:
        _write_sacct_shim(cluster)
    cluster.save()

    env = cluster.env
    log = d / "log"

    def launch(name: str, cmd: List[str], logfile: Path) -> dict:
        out = open(log / f"{name}.out", "ab")
        proc = subprocess.Popen(
            cmd,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd=str(d),
        )
        out.close()
        cluster._popen[proc.pid] = proc
        entry = {"name": name, "pid": proc.pid, "start": _proc_start(proc.pid), "cmd": cmd, "log": str(logfile)}
        cluster.processes.append(entry)
        cluster.save()
        return entry

    def wait_for(what: str, ok, entries: List[dict]) -> None:
        deadline = time.monotonic() + timeout
        while not ok():
            dead = [e for e in entries if not _alive(e["pid"], e.get("start"))]
            if dead or time.monotonic() > deadline:
                why = f"{', '.join(e['name'] for e in dead)} exited" if dead else f"not after {timeout:.0f}s"
                raise ClusterError(f"SLURM cluster in {d}: {what}: {why}\n{_logs(cluster)}")
            time.sleep(0.2)

    munged = launch(
        "munged",
        [
            which("munged"),
            "--foreground",
            "--force",
            f"--socket={cluster.munge_socket}",
            f"--key-file={key}",
            f"--pid-file={d / 'munge' / 'munged.pid'}",
            f"--log-file={log / 'munged.log'}",
            f"--seed-file={d / 'munge' / 'munged.seed'}",
            "--num-threads=2",
        ],
        log / "munged.log",
    )
    wait_for("munged socket", cluster.munge_socket.exists, [munged])
    ctld = launch("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(cluster.conf)], log / "slurmctld.log")
    wait_for(
        "slurmctld answering `scontrol ping`",
        lambda: "UP" in cluster.run("scontrol", "ping", check=False, timeout=10).stdout,
        [munged, ctld],
    )
    ds = [
        launch(f"slurmd-{n}", [which("slurmd"), "-D", "-N", n, "-f", str(cluster.conf)], log / f"slurmd-{n}.log")
        for n in cluster.nodes
    ]

    def all_idle() -> bool:
        states = cluster.node_states()
        if any(s.startswith("inval") for s in states.values()):  # e.g. config above what slurmd detects
            raise ClusterError(f"SLURM cluster in {d}: node(s) invalid in sinfo: {states}\n{_logs(cluster)}")
        return len(states) == len(cluster.nodes) and all(s == "idle" for s in states.values())

    wait_for(f"node(s) {','.join(cluster.nodes)} idle in sinfo", all_idle, [munged, ctld, *ds])


def _logs(cluster: Cluster) -> str:
    parts = [f"sinfo: {cluster.node_states() or '(no answer)'}"]
    logdir = cluster.dir / "log"
    for path in sorted(logdir.glob("*")) if logdir.exists() else []:
        parts.append(f"--- {path}:\n{_tail(path)}")
    return "\n".join(parts)


# ----------------------------------------------------------------------------------------------- job state


def _conf_env(dir: Path) -> Dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["SLURM_CONF"] = str(Path(dir) / "slurm.conf")
    return env


def _key(rec: Dict[str, str]) -> str:
    """sacct's name for a record: `12`, an array task `12_3`, or the array's pending rest `12_[4-7%2]`."""
    a, t = rec.get("ArrayJobId"), rec.get("ArrayTaskId")
    if not a or t in (None, "", "N/A"):
        return rec.get("JobId", "")
    return f"{a}_[{t}]" if any(c in t for c in "-,%") else f"{a}_{t}"


def _matches(rec: Dict[str, str], job_id: str) -> bool:
    if "_" in job_id:
        return _key(rec) == job_id
    return rec.get("JobId") == job_id or rec.get("ArrayJobId") == job_id


def job_records(job_id: str, dir: Optional[os.PathLike] = None) -> List[Dict[str, str]]:
    """Every record SLURM has for a job id (`12`: the job, or each task of array 12; `12_3`: that task).

    Sources, best first: `scontrol show job -o` while slurmctld keeps the job (until MinJobAge after it
    ends), then the jobcomp/filetxt file (one line each time a job ends, requeues included, kept for
    good: the last line of a job wins). Each record is a dict of SLURM's keys (JobId, JobState, NodeList,
    SubmitTime, StartTime, EndTime, ExitCode, Reason, ArrayJobId, ArrayTaskId...) plus Source."""
    dir = Path(dir or DEFAULT_DIR)
    job_id = str(job_id)
    found: Dict[str, Dict[str, str]] = {}
    try:
        with open(dir / "jobcomp.txt", errors="replace") as f:
            for line in f:
                if line.startswith("JobId="):
                    rec = parse_record(line)
                    if _matches(rec, job_id):
                        rec["Source"] = "jobcomp"
                        found[_key(rec)] = rec
    except OSError:
        pass
    lines: List[str] = []
    if (dir / "slurm.conf").exists():  # without it scontrol goes looking for a configless controller (slow)
        try:
            proc = subprocess.run(
                [which("scontrol") or "scontrol", "show", "job", "-o", job_id],
                env=_conf_env(dir),
                capture_output=True,
                text=True,
                timeout=15,
            )
            lines = proc.stdout.splitlines() if proc.returncode == 0 else []
        except (OSError, subprocess.TimeoutExpired):
            pass
    for line in lines:
        rec = parse_record(line)
        if _matches(rec, job_id):
            rec["Source"] = "scontrol"
            found[_key(rec)] = rec
    return sorted(found.values(), key=lambda r: (int(r.get("ArrayJobId") or r.get("JobId") or 0), _key(r)))


def job_record(job_id: str, dir: Optional[os.PathLike] = None) -> Optional[Dict[str, str]]:
    """The record of one job (`12`) or array task (`12_3`), None if SLURM does not know it (see job_records)."""
    job_id = str(job_id)
    recs = job_records(job_id, dir)
    exact = [r for r in recs if (_key(r) if "_" in job_id else r.get("JobId")) == job_id]
    return exact[0] if exact else None


def final_state(job_id: str, dir: Optional[os.PathLike] = None) -> Optional[str]:
    """SLURM's final state of a job or array task: COMPLETED, CANCELLED, TIMEOUT, NODE_FAIL, FAILED,
    OUT_OF_MEMORY...; None while it is pending/running/requeued, or when SLURM does not know it."""
    rec = job_record(job_id, dir)
    state = (rec or {}).get("JobState", "").split(" ")[0]
    return state if state in TERMINAL_STATES else None


def _sacct(dir: Path, argv: List[str]) -> int:
    """The part of sacct that submitit uses (`-o JobID,State,NodeList --parsable2 -j ID ...`), from job_records."""
    p = argparse.ArgumentParser(prog="sacct", add_help=False)
    p.add_argument("-o", "--format", default="JobID,JobName,Partition,State,ExitCode")
    p.add_argument("-j", "--jobs", action="append", default=[])
    p.add_argument("-P", "--parsable2", action="store_true")
    p.add_argument("-p", "--parsable", action="store_true")
    p.add_argument("-n", "--noheader", action="store_true")
    args, _ = p.parse_known_args(argv)
    fields = [f.split("%")[0] for f in args.format.split(",")]
    alias = {
        "state": "JobState",
        "nodelist": "NodeList",
        "jobname": "JobName",
        "exitcode": "ExitCode",
        "start": "StartTime",
        "end": "EndTime",
        "submit": "SubmitTime",
        "partition": "Partition",
        "elapsed": "RunTime",
        "timelimit": "TimeLimit",
        "reason": "Reason",
        "restarts": "Restarts",
    }
    tail = "|" if args.parsable else ""
    out = [] if args.noheader else ["|".join(fields) + tail]
    for jid in (i for j in args.jobs for i in j.split(",") if i):
        for rec in job_records(jid.split(".")[0], dir):
            rec.setdefault("JobName", rec.get("Name", ""))
            row = [_key(rec) if f.lower() == "jobid" else rec.get(alias.get(f.lower(), f), "") for f in fields]
            out.append("|".join(v.replace("|", " ") for v in row) + tail)
    print("\n".join(out))
    return 0


# ----------------------------------------------------------------------------------------------- CLI


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("start", help="start the cluster, wait until its nodes are idle")
    s.add_argument("--dir", type=Path, default=DEFAULT_DIR, help=f"folder for everything (default {DEFAULT_DIR})")
    s.add_argument("--nodes", type=int, choices=(1, 2), default=1)
    s.add_argument("--port", type=int, default=DEFAULT_PORT, help="slurmctld port; slurmd use the next 1-2")
    s.add_argument("--timeout", type=float, default=60)
    s.add_argument("--no-sacct", action="store_true", help="do not put the sacct shim on PATH")
    for name in ("stop", "status"):
        x = sub.add_parser(name)
        x.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    x = sub.add_parser("sacct", help=argparse.SUPPRESS)
    x.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    x = sub.add_parser("final-state", help="print a job's final state (or nothing while it runs)")
    x.add_argument("job_id")
    x.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args, rest = ap.parse_known_args(argv)
    if rest and args.cmd != "sacct":
        ap.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.cmd == "start":
            t0 = time.monotonic()
            c = start_cluster(args.dir, args.nodes, args.port, args.timeout, sacct_shim=not args.no_sacct)
            print(
                f"# SLURM cluster up in {time.monotonic() - t0:.1f}s: nodes {','.join(c.nodes)} idle; "
                f"stop with: {sys.argv[0]} stop --dir {c.dir}",
                file=sys.stderr,
            )
            print(f"export SLURM_CONF={shlex.quote(str(c.conf))}")
            if c.sacct_shim:
                print(f'export PATH={shlex.quote(str(c.dir / "bin"))}:"$PATH"')
        elif args.cmd == "stop":
            for line in Cluster.load(args.dir).stop():
                print(line)
        elif args.cmd == "status":
            c = Cluster.load(args.dir)
            alive = c.alive()
            for p in c.processes:
                print(f"{p['name']:12} pid {p['pid']:>7}  {'running' if alive[p['name']] else 'gone'}")
            print(f"nodes: {c.node_states() or '(slurmctld not answering)'}")
            print(f"export SLURM_CONF={c.conf}")
            return 0 if alive and all(alive.values()) else 1
        elif args.cmd == "sacct":
            return _sacct(args.dir, rest)
        elif args.cmd == "final-state":
            print(final_state(args.job_id, args.dir) or "")
    except ClusterError as e:
        print(f"slurm_cluster: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
