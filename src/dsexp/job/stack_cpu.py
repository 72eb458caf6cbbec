"""Before any rank starts: can a stack's wheels run on this CPU at all? A wheel is built for a baseline instruction
set (NumPy's x86 wheels refuse to import below theirs, naming it; a compiled extension built for a newer set dies of
SIGILL on import). One short process imports the stack's packages as a rank would (its overlay first on the path);
where it dies of SIGILL or NumPy names a baseline the CPU lacks, the job is refused with the missing instruction set
named, before the checkpoint is written or a rank launched. The answer is kept per stack and CPU (its flags), so the
probe runs once. Not the shared-memory all-reduce (that is reached only in a forward: dsexp.rank.shm_fallback), and
not the current stack, which dsexp itself runs on.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Mapping

from dsexp.core.cpu import ASSUME_NO_AVX512_ENV, features, flags
from dsexp.job.illegal_instruction import died_of_sigill, explain, few
from dsexp.job.overlay import StackError

# what a rank imports first, and one op of each (a kernel of the wheel's baseline runs at the first op, not at import)
PROBE = (
    "import faulthandler, importlib, sys; faulthandler.enable()\n"
    "for name in sys.argv[1:]:\n"
    "    importlib.import_module(name)\n"
    "import numpy, torch\n"
    "numpy.ones(64) @ numpy.ones(64); torch.ones(64) @ torch.ones(64)\n"
)
_NUMPY_BASELINE = re.compile(
    r"NumPy was built with baseline optimizations:\s*\(([^)]*)\)\s*but your machine doesn't support:\s*\(([^)]*)\)"
)
TIMEOUT_S = 300.0


class UnrunnableStack(StackError):
    """The stack's wheels cannot run on this CPU (the message names the missing instruction set)."""


def check(stack_info: Mapping[str, Any], env: Mapping[str, str], cpuinfo: str = "/proc/cpuinfo") -> None:
    """Raise UnrunnableStack where the stack's packages cannot run on this CPU; an overlay stack only (`site`)."""
    site = stack_info.get("site")
    if not site:
        return
    mark = Path(site).parent / f"cpu-{cpu_key(cpuinfo)}.json"
    if mark.is_file():
        verdict = json.loads(mark.read_text())
    else:
        verdict = probe(list(stack_info.get("modules") or []), env, cpuinfo)
        mark.write_text(json.dumps(verdict))
    if not verdict["runs"]:
        raise UnrunnableStack(f"stack {stack_info.get('label')}: {verdict['message']}")


def cpu_key(cpuinfo: str = "/proc/cpuinfo") -> str:
    """This CPU, as the probe's answer depends on it: its flags (and whether AVX-512 is assumed away)."""
    blob = " ".join(sorted(flags(cpuinfo) or [])) + f"|{os.environ.get(ASSUME_NO_AVX512_ENV, '')}"
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def probe(modules: List[str], env: Mapping[str, str], cpuinfo: str = "/proc/cpuinfo") -> Dict[str, Any]:
    """{runs, message, ...}: import `modules` and run one op of NumPy and torch in a process of `env`."""
    try:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, *modules],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=TIMEOUT_S,
        )
    except subprocess.TimeoutExpired:
        return {"runs": True, "message": f"the import probe did not finish in {TIMEOUT_S:.0f} s: not decided"}
    log = (out.stdout or "") + (out.stderr or "")
    cpu = features(cpuinfo)
    baseline = _NUMPY_BASELINE.search(log)
    if baseline:
        missing = baseline.group(2).split()
        return {
            "runs": False,
            "missing": missing,
            "library": "numpy",
            "message": f"its NumPy wheel is built for the baseline {baseline.group(1).strip()} and this CPU lacks "
            f"{', '.join(missing)}: use a NumPy built for this CPU (an older release, or built from source with "
            "-Dcpu-baseline=min)",
        }
    if died_of_sigill(out.returncode, log):
        info = explain(0, log, cpu)
        lib = info["library"] or "a compiled extension"
        at = f" at {info['frame']}" if info["frame"] else ""
        lacks = few(info["cpu_lacks"]) or "none of the x86 vector sets dsexp reads"
        return {
            "runs": False,
            "missing": info["cpu_lacks"],
            "library": lib,
            "message": f"importing it dies of SIGILL (an illegal instruction){at} ({lib}): a wheel built for an "
            f"instruction set this CPU lacks ({lacks}); use that package's build for this CPU, or another machine",
        }
    return {"runs": True, "message": "imported and ran", "returncode": out.returncode}
