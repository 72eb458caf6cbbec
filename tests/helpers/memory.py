"""Host memory a test can count on: a buffer whose every page is written, so it is resident whatever the heap held.

`bytearray(n)` may come from calloc'd pages the kernel has not mapped yet (not resident until written) or from heap
pages an earlier test left dirty (resident already): the RSS it adds then depends on what ran before in the process.
"""

from __future__ import annotations

import mmap

PAGE = mmap.PAGESIZE


def resident(nbytes: int) -> bytearray:
    """nbytes of host memory, every page written: RSS and the anonymous part grow by nbytes while it lives."""
    buf = bytearray(nbytes)
    buf[::PAGE] = b"\x01" * len(range(0, nbytes, PAGE))
    return buf
