"""A stack whose wheels cannot run on this CPU at all is refused before launch, the missing instruction set named
(issue 46): a stand-in overlay whose `numpy` refuses its baseline as NumPy's wheels word it, and one whose import
executes an illegal instruction (a real SIGILL from the CPU)."""

from __future__ import annotations

import os
import platform
import textwrap

import pytest

from dsexp.job import stack_cpu
from dsexp.job.overlay import StackError

BASELINE_ERROR = (
    "raise RuntimeError(\"NumPy was built with baseline optimizations: (X86_V3) but your machine doesn't support: "
    '(AVX2 FMA3).")'
)
ILLEGAL = """
import ctypes, mmap, platform
INVALID = b"\\x00\\x00\\x00\\x00" if platform.machine() in ("aarch64", "arm64") else b"\\x0f\\x0b"
def load_kernels():
    code = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
    code.write(INVALID)
    ctypes.CFUNCTYPE(None)(ctypes.addressof(ctypes.c_char.from_buffer(code)))()
load_kernels()
"""


def overlay(tmp_path, numpy_init: str):
    """A stack's folder whose site/ holds a `numpy` package of `numpy_init`, as prepare_stack describes it."""
    site = tmp_path / "stack" / "site"
    (site / "numpy").mkdir(parents=True)
    (site / "numpy" / "__init__.py").write_text(textwrap.dedent(numpy_init))
    info = {"label": "numpy==9.9", "site": str(site), "modules": []}
    env = {**os.environ, "PYTHONPATH": str(site)}
    return info, env


def test_a_numpy_built_for_a_baseline_the_cpu_lacks_is_refused_naming_it(tmp_path):
    info, env = overlay(tmp_path, BASELINE_ERROR)
    with pytest.raises(StackError) as e:
        stack_cpu.check(info, env)
    msg = str(e.value)
    assert msg.startswith("stack numpy==9.9: its NumPy wheel is built for the baseline X86_V3")
    assert "this CPU lacks AVX2, FMA3" in msg
    # kept per stack and CPU: the next job reads the answer without a probe
    (mark,) = (tmp_path / "stack").glob("cpu-*.json")
    assert '"runs": false' in mark.read_text()
    (tmp_path / "stack" / "site" / "numpy" / "__init__.py").write_text("")
    with pytest.raises(StackError):
        stack_cpu.check(info, env)


@pytest.mark.skipif(platform.machine() not in ("x86_64", "aarch64"), reason="ud2 / udf #0 are x86's and aarch64's")
def test_a_wheel_that_dies_of_sigill_on_import_is_refused_naming_the_library_and_what_the_cpu_lacks(
    tmp_path, monkeypatch
):
    monkeypatch.setenv("DSEXP_ASSUME_NO_AVX512", "1")
    info, env = overlay(tmp_path, ILLEGAL)
    env["DSEXP_ASSUME_NO_AVX512"] = "1"
    with pytest.raises(StackError) as e:
        stack_cpu.check(info, env)
    msg = str(e.value)
    assert "dies of SIGILL (an illegal instruction) at __init__.py:" in msg and "in load_kernels" in msg
    if platform.machine() == "x86_64":
        assert "avx512f" in msg  # AVX-512 assumed away: among what this CPU lacks


def test_the_current_stack_and_a_stack_that_imports_are_not_refused(tmp_path):
    stack_cpu.check({"label": "current", "site": None}, dict(os.environ))  # no overlay: dsexp runs on it
    info, env = overlay(tmp_path, "ones = None\n")  # imports; its op fails otherwise: not this check's business
    stack_cpu.check(info, env)
