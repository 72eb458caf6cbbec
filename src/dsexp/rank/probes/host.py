"""Host memory of this process and of the node.

Anonymous vs file-backed resident memory is the distinction that matters for model loading: a
safetensors checkpoint that is mmap'd and not converted lives in the page cache (file-backed, shared
by every rank), while a conversion or a `.bin` load makes a private, anonymous copy per rank.
"""

from __future__ import annotations

import contextlib
import os
from typing import Dict

import psutil

_STATUS_KEYS = (
    (b"VmRSS:", "host_rss"),
    (b"RssAnon:", "host_anon"),
    (b"RssFile:", "host_file"),
    (b"RssShmem:", "host_shmem"),
)


def parse_status(data: bytes) -> Dict[str, int]:
    """RSS split into anon / file / shmem, in bytes, from the text of /proc/<pid>/status."""
    out: Dict[str, int] = {}
    for key, name in _STATUS_KEYS:
        i = data.find(key)
        if i >= 0:
            out[name] = int(data[i + len(key) : data.index(b"kB", i)]) * 1024
    return out


def parse_meminfo_used(data: bytes) -> int:
    """total - available from the text of /proc/meminfo (both are in its first lines)."""
    total = int(data[data.index(b"MemTotal:") + 9 : data.index(b"kB", data.index(b"MemTotal:"))])
    i = data.index(b"MemAvailable:")
    return (total - int(data[i + 13 : data.index(b"kB", i)])) * 1024


def status_rss(path: str = "/proc/self/status") -> Dict[str, int]:
    """RSS split into anon / file / shmem, in bytes."""
    with open(path, "rb") as f:
        return parse_status(f.read())


def node_used() -> int:
    """Node-wide used memory as DeepSpeed's see_memory_usage computes it: total - available."""
    with open("/proc/meminfo", "rb") as f:
        return parse_meminfo_used(f.read(1024))


class ProcFiles:
    """/proc/self/status and /proc/meminfo held open and re-read with pread: two system calls a reading.

    The sampler's hot path. Every system call releases the GIL, and while the rank's main thread runs Python,
    taking it back waits up to the interpreter's switch interval (5 ms); an open/read/close per file made a
    sample cost several of those waits, and the main thread as many forced switches."""

    def __init__(self):
        self._status = os.open("/proc/self/status", os.O_RDONLY)
        self._meminfo = os.open("/proc/meminfo", os.O_RDONLY)

    def read(self) -> Dict[str, int]:
        vals = parse_status(os.pread(self._status, 16384, 0))
        vals["node_used"] = parse_meminfo_used(os.pread(self._meminfo, 1024, 0))
        return vals

    def close(self) -> None:
        for fd in (self._status, self._meminfo):
            with contextlib.suppress(OSError):
                os.close(fd)


def host_snapshot() -> Dict[str, int]:
    """Full picture at a phase boundary: RSS split, USS/PSS (smaps_rollup), node used/available/cache."""
    full = psutil.Process().memory_full_info()
    vm = psutil.virtual_memory()
    snap = status_rss()
    snap.update(
        host_uss=full.uss,
        host_pss=full.pss,
        node_used=vm.total - vm.available,
        node_available=vm.available,
        node_cached=getattr(vm, "cached", 0) + getattr(vm, "buffers", 0),
        node_shared=getattr(vm, "shared", 0),
        node_total=vm.total,
    )
    return snap
