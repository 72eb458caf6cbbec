"""scripts/gpu/env.sh, sourced as docs/gpu.md says, on a stand-in machine: `python3` and `nvidia-smi` are shell
stubs on PATH (no wheel is installed, no GPU is needed). What is checked is the script's own shell: the exports it
sets, the caller's options it leaves alone and the status it returns from `source`."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The caller: options chosen unlike env.sh's old `set -eo pipefail`; after `source` it prints its options, the
# status `source` returned and one variable env.sh exports. A shell that closed prints nothing after the source.
CALLER = """
set +e +o pipefail
source scripts/gpu/env.sh; status=$?
echo "options: $(set -o | awk '$1 == "errexit" || $1 == "pipefail" {print $1 "=" $2}' | tr '\\n' ' ')"
echo "status: $status"
echo "cache: ${DSEXP_CACHE:-unset}"
"""


def stub(folder: Path, name: str, body: str) -> None:
    path = folder / name
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def source_env(tmp_path: Path, pip_status: int) -> str:
    """Source env.sh from a bash whose `python3 -m pip` exits with pip_status; its output."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub(bin_dir, "python3", f'[ "$1" = -m ] && exit {pip_status}; echo "python3 $*"')
    stub(bin_dir, "nvidia-smi", 'echo "index, name"; echo "0, stand-in GPU"')
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "OUT": str(tmp_path / "out")}
    env.pop("DSEXP_CACHE", None)
    proc = subprocess.run(["bash", "-c", CALLER], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    return proc.stdout + proc.stderr


def test_sourcing_it_sets_the_environment_and_leaves_the_callers_options(tmp_path):
    out = source_env(tmp_path, pip_status=0)
    assert "options: errexit=off pipefail=off" in out, out
    assert "status: 0" in out and "cache: /tmp/dsexp-cache" in out, out
    assert (tmp_path / "out" / "gpus.csv").read_text().startswith("index, name"), out


def test_a_failed_install_returns_1_from_source_and_the_caller_goes_on(tmp_path):
    out = source_env(tmp_path, pip_status=1)
    assert "env.sh: installing the wheels in .whl failed" in out, out
    assert "options: errexit=off pipefail=off" in out and "status: 1" in out, out
    assert "cache: unset" in out, out  # nothing is set after the failed step
