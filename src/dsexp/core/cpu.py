"""The instruction sets of this machine's CPU that compiled kernels are built for (PyTorch's, oneDNN's, DeepSpeed's
CPU ops), read from /proc/cpuinfo's flags. A kernel built for a set the CPU lacks dies of SIGILL (an illegal
instruction): DeepSpeed 0.14.4's CPU shared-memory all-reduce needs avx512bw, for one.

DSEXP_ASSUME_NO_AVX512=1 makes dsexp treat the CPU as one without AVX-512 (and AMX) whatever it has, so that a test
or CI covers what dsexp does on such a CPU. Standard library only: the ranks read it before anything is imported.
"""

from __future__ import annotations

import os
import platform
from typing import Dict, List, Optional

ASSUME_NO_AVX512_ENV = "DSEXP_ASSUME_NO_AVX512"
# x86's vector sets, oldest first, as /proc/cpuinfo names them
SIMD = (
    "sse4_1", "sse4_2", "avx", "f16c", "fma", "avx2", "avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl",
    "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8",
)  # fmt: skip
_WIDE = ("avx512", "amx")  # what DSEXP_ASSUME_NO_AVX512 takes away


def assume_no_avx512() -> bool:
    return os.environ.get(ASSUME_NO_AVX512_ENV, "").strip().lower() in ("1", "true", "yes")


def flags(path: str = "/proc/cpuinfo") -> Optional[List[str]]:
    """The first processor's flags (x86's `flags`, ARM's `Features`); None where there is no such file or line."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() in ("flags", "Features"):
                    return value.split()
    except OSError:
        return None
    return None


def features(path: str = "/proc/cpuinfo") -> Dict[str, object]:
    """{arch, has, lacks, assumed_no_avx512}: which of SIMD the CPU has and lacks (x86 only: elsewhere both empty);
    under DSEXP_ASSUME_NO_AVX512=1 the AVX-512 and AMX sets are counted as lacking."""
    arch, present = platform.machine(), flags(path)
    assumed = assume_no_avx512()
    if present is None or arch not in ("x86_64", "AMD64", "i686", "i386"):
        return {"arch": arch, "has": [], "lacks": [], "assumed_no_avx512": assumed}
    have = set(present)
    if assumed:
        have = {f for f in have if not f.startswith(_WIDE)}
    return {
        "arch": arch,
        "has": [s for s in SIMD if s in have],
        "lacks": [s for s in SIMD if s not in have],
        "assumed_no_avx512": assumed,
    }
