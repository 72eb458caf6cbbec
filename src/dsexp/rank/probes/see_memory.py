"""What DeepSpeed's own `see_memory_usage` prints, captured so users can map their numbers onto ours.

It prints on rank 0 only once torch.distributed is initialised, its GPU figures are torch's
allocator view in GiB (labelled GB), and its CPU figure is node-wide (total - available). DeepSpeed 0.19 prints
it to stdout; 0.14 (the seed's) logs it through its "DeepSpeed" logger: both are captured.
"""

from __future__ import annotations

import contextlib
import io
import logging
import re
from typing import Any, Dict

_NUM = r"([-0-9.]+)"
_PATTERNS = {
    "MA_GB": rf"\bMA {_NUM} GB",
    "Max_MA_GB": rf"Max_MA {_NUM} GB",
    "CA_GB": rf"\bCA {_NUM} GB",
    "Max_CA_GB": rf"Max_CA {_NUM} GB",
    "cpu_used_GB": rf"used = {_NUM} GB",
    "cpu_percent": rf"percent = {_NUM}%",
}


def capture(message: str) -> Dict[str, Any]:
    from deepspeed.runtime.utils import see_memory_usage

    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    logger = logging.getLogger("DeepSpeed")
    logger.addHandler(handler)
    try:
        with contextlib.redirect_stdout(buf):
            see_memory_usage(message, force=True)
    finally:
        logger.removeHandler(handler)
    return parse(buf.getvalue())


def parse(text: str) -> Dict[str, Any]:
    out: Dict[str, Any] = {"printed": bool(text.strip()), "text": text.strip()}
    for key, pat in _PATTERNS.items():
        m = re.search(pat, text)
        if m:
            out[key] = float(m.group(1))
    return out
