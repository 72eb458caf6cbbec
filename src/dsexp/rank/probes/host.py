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


# the kernel's high-water mark of the process's RSS: its exact peak over the process's life, whatever the sampler saw
_HWM_KEY = ((b"VmHWM:", "host_rss_hwm"),)


def parse_status(data: bytes, keys=_STATUS_KEYS) -> Dict[str, int]:
    """RSS split into anon / file / shmem (or the fields `keys` names), in bytes, from /proc/<pid>/status's text."""
    out: Dict[str, int] = {}
    for key, name in keys:
        i = data.find(key)
        if i >= 0:
            out[name] = int(data[i + len(key) : data.index(b"kB", i)]) * 1024
    return out


def parse_meminfo_used(data: bytes) -> int:
    """total - available from the text of /proc/meminfo (both are in its first lines)."""
    total = int(data[data.index(b"MemTotal:") + 9 : data.index(b"kB", data.index(b"MemTotal:"))])
    i = data.index(b"MemAvailable:")
    return (total - int(data[i + 13 : data.index(b"kB", i)])) * 1024


def status_rss(path: str = "/proc/self/status", hwm: bool = False) -> Dict[str, int]:
    """RSS split into anon / file / shmem, in bytes; with `hwm`, also `host_rss_hwm` (VmHWM: the peak RSS so far)."""
    with open(path, "rb") as f:
        return parse_status(f.read(), _STATUS_KEYS + _HWM_KEY if hwm else _STATUS_KEYS)


def node_used() -> int:
    """Node-wide used memory as DeepSpeed's see_memory_usage computes it: total - available."""
    with open("/proc/meminfo", "rb") as f:
        return parse_meminfo_used(f.read(1024))


def parse_statm(data: bytes, page: int) -> Dict[str, int]:
    """RSS and its anonymous part, in bytes, from the text of /proc/<pid>/statm (size resident shared ...): `shared`
    counts the file-backed and shmem pages, so resident - shared is status's RssAnon."""
    fields = data.split(None, 3)
    rss, shared = int(fields[1]) * page, int(fields[2]) * page
    return {"host_rss": rss, "host_anon": rss - shared}


class ProcFiles:
    """/proc/self/statm, /proc/self/status and /proc/meminfo held open and re-read with pread.

    The sampler's hot path. Every system call releases the GIL, and while the rank's main thread runs Python,
    taking it back waits up to the interpreter's switch interval (5 ms); an open/read/close per file made a
    sample cost several of those waits, and the main thread as many forced switches. And after each sleep
    each distinct kernel path runs cold (25-90 us of CPU for a read that costs 2-15 us warm on the H200,
    benchmarks/sampler_cost.py): the frequent reading (`read_rss`) is statm alone, the full one (`read`) adds
    status's split and the node's figure."""

    def __init__(self):
        self._statm = os.open("/proc/self/statm", os.O_RDONLY)
        self._status = os.open("/proc/self/status", os.O_RDONLY)
        self._meminfo = os.open("/proc/meminfo", os.O_RDONLY)
        self._page = os.sysconf("SC_PAGE_SIZE")

    def read_rss(self) -> Dict[str, int]:
        """host_rss and host_anon: one short read."""
        return parse_statm(os.pread(self._statm, 256, 0), self._page)

    def read(self) -> Dict[str, int]:
        """RSS split into anon / file / shmem, and the node's used memory."""
        vals = parse_status(os.pread(self._status, 16384, 0))
        vals["node_used"] = parse_meminfo_used(os.pread(self._meminfo, 1024, 0))
        return vals

    def close(self) -> None:
        for fd in (self._statm, self._status, self._meminfo):
            with contextlib.suppress(OSError):
                os.close(fd)


def host_snapshot() -> Dict[str, int]:
    """Full picture at a phase boundary: RSS split and its high-water mark so far, USS/PSS (smaps_rollup), node
    used/available/cache."""
    full = psutil.Process().memory_full_info()
    vm = psutil.virtual_memory()
    snap = status_rss(hwm=True)
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


def process_started() -> float:
    """This process's creation on time.time()'s clock, to a 10 ms tick: its start tick (/proc/self/stat) against the
    time since boot (/proc/uptime). psutil's create_time adds the start tick to the boot time /proc/stat gives in whole
    seconds, so it read up to a second early against time.time() (a rank 'created' 33 ms before its launcher's
    Popen). Elsewhere than Linux: psutil's."""
    import time

    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
        return time.time() - (uptime - start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        return psutil.Process().create_time()
