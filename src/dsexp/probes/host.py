"""Host memory of this process and of the node.

Anonymous vs file-backed resident memory is the distinction that matters for model loading: a
safetensors checkpoint that is mmap'd and not converted lives in the page cache (file-backed, shared
by every rank), while a conversion or a `.bin` load makes a private, anonymous copy per rank.
"""
from __future__ import annotations

from typing import Dict

import psutil

_STATUS_KEYS = {"VmRSS:": "host_rss", "RssAnon:": "host_anon", "RssFile:": "host_file", "RssShmem:": "host_shmem"}


def status_rss(path: str = "/proc/self/status") -> Dict[str, int]:
    """RSS split into anon / file / shmem, in bytes (cheap enough for the sampler)."""
    out: Dict[str, int] = {}
    with open(path, "rb") as f:
        for line in f:
            parts = line.split()
            key = _STATUS_KEYS.get(parts[0].decode()) if parts else None
            if key:
                out[key] = int(parts[1]) * 1024
    return out


def node_used() -> int:
    """Node-wide used memory as DeepSpeed's see_memory_usage computes it: total - available."""
    total = avail = 0
    with open("/proc/meminfo", "rb") as f:
        for line in f:
            if line.startswith(b"MemTotal:"):
                total = int(line.split()[1]) * 1024
            elif line.startswith(b"MemAvailable:"):
                avail = int(line.split()[1]) * 1024
                break
    return total - avail


def host_snapshot() -> Dict[str, int]:
    """Full picture at a phase boundary: RSS split, USS/PSS (smaps_rollup), node used/available/cache."""
    full = psutil.Process().memory_full_info()
    vm = psutil.virtual_memory()
    snap = status_rss()
    snap.update(host_uss=full.uss, host_pss=full.pss, node_used=vm.total - vm.available,
                node_available=vm.available, node_cached=getattr(vm, "cached", 0) + getattr(vm, "buffers", 0),
                node_shared=getattr(vm, "shared", 0), node_total=vm.total)
    return snap
