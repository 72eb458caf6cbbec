"""Test helpers for the cluster path: a real `mlflow server` on 127.0.0.1, and fake cluster commands.

The fake `srun` and `pdsh` run their command once per node, all on this machine; the fake `scontrol`
expands any node list to the hosts given; the fake `ssh` runs locally. Together they let a multi-node
job go through the real launch path (srun + torchrun rendezvous, or DeepSpeed's runner) on one box.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Iterator, List

import requests

from dsexp.job.launch import free_port

FAKE_SRUN = """#!/bin/bash
# fake srun: run the command once per "node", all on this machine (so every rank is local to it)
n=1
while [[ $1 == --* ]]; do case $1 in --nodes=*) n=${1#--nodes=};; esac; shift; done
pids=()
for ((i = 0; i < n; i++)); do SLURM_NODEID=$i SLURM_PROCID=$i "$@" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""

FAKE_PDSH = """#!/bin/bash
# fake pdsh: run the remote command once per host of -w, all on this machine (%n = the host's index)
hosts=
while [[ $1 == -* ]]; do case $1 in -w) hosts=$2; shift;; -f) shift;; esac; shift; done
IFS=, read -ra hs <<< "$hosts"
pids=()
for i in "${!hs[@]}"; do bash -c "${*//%n/$i}" & pids+=($!); done
rc=0; for p in "${pids[@]}"; do wait "$p" || rc=$?; done; exit $rc
"""

FAKE_SSH = """#!/bin/bash
# fake ssh: every host is this machine (DeepSpeed's runner checks `ssh HOST hostname`)
exec "${@: -1}"
"""

FAKE_SCONTROL = """#!/bin/bash
[[ "$1 $2" == "show hostnames" && -n "$3" ]] || { echo "fake scontrol: unexpected $*" >&2; exit 2; }
printf '%s\\n' {hosts}
"""


def comparable(res: dict):
    """What must not depend on the launcher: the config (less tracking) and the weights each rank holds."""
    config = {k: v for k, v in res["config"].items() if k != "tracking"}
    weights = [
        (rk["rank"], rk["phases"]["load"]["weights_device"], rk["phases"]["init"]["weights_device"])
        for rk in res["ranks"]
    ]
    return res["key"], config, weights, res["ranks"][0]["generate"]["tokens"]


def fake_slurm_bin(folder: Path, hosts: List[str]) -> Path:
    """A bin/ folder with fake `srun`, `scontrol`, `pdsh` and `ssh` (put it first on PATH)."""
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {
        "srun": FAKE_SRUN,
        "scontrol": FAKE_SCONTROL.replace("{hosts}", " ".join(hosts)),
        "pdsh": FAKE_PDSH,
        "ssh": FAKE_SSH,
    }
    for name, text in scripts.items():
        (folder / name).write_text(text)
        (folder / name).chmod(0o755)
    return folder


@contextlib.contextmanager
def mlflow_server(root: Path, timeout_s: float = 120) -> Iterator[str]:
    """`mlflow server` with a sqlite store and served artifacts under root; yields its http URI."""
    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    mlflow_bin = Path(sys.executable).parent / "mlflow"
    cmd = [
        str(mlflow_bin),
        "server",
        "--backend-store-uri",
        f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination",
        str(root / "artifacts"),
        "--serve-artifacts",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--workers",
        "1",
    ]
    root.mkdir(parents=True, exist_ok=True)
    log = open(root / "server.log", "ab")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"mlflow server exited ({proc.returncode}): {(root / 'server.log').read_text()[-2000:]}"
                )
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{uri}/health", timeout=2).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise RuntimeError(f"mlflow server did not answer within {timeout_s} s")
            time.sleep(0.5)
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()
