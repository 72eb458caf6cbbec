"""A rank's output: its stdout and stderr (C level too: NCCL, faults) into its own log, with its stacks on request."""

from __future__ import annotations

import faulthandler
import os
import signal
import sys
from pathlib import Path

from dsexp.core.protocol import STACK_SIGNAL

_TERMINATED = None  # kept open: faulthandler writes into it from its signal handler


def redirect_output(log: Path) -> None:
    """Send this process's stdout/stderr (C level too: NCCL, faults) to the rank's own log."""
    log.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The job sends SIGUSR1 before killing a hung job: every thread's stack lands in this log.
    faulthandler.register(STACK_SIGNAL, file=sys.stderr, all_threads=True)
    # A launcher SIGTERMs the other ranks when one fails: the stacks go to rank{N}.terminated, then the default
    # action. Done in C, so it works while the rank spins in a collective holding the GIL; the job reads the
    # file to tell ranks that were stopped from the rank that failed.
    global _TERMINATED
    _TERMINATED = open(log.with_suffix(".terminated"), "w")
    faulthandler.register(signal.SIGTERM, file=_TERMINATED, all_threads=True, chain=True)
