"""What PyTorch's CUDA caching allocator reserves to hold a rank's weights: its segments, not the tensors' bytes.

The allocator rounds every request to 512 bytes and takes memory from the driver in segments: 2 MiB for requests
up to 1 MiB (the small pool, shared by many), 20 MiB for requests between 1 and 10 MiB (the rest of the segment
serves later requests of that size class), and the request rounded up to 2 MiB above that. A free block is reused
best-fit within its pool and split where more than 1 MiB (large pool) or 512 bytes (small pool) would be left;
otherwise the whole block is handed out. These are the rules of c10's CUDACachingAllocator (unchanged from torch
1.x to 2.11) without `expandable_segments` or `max_split_size_mb`.

Nothing is freed while the weights are placed, so replaying the allocations in the order the engine makes them
gives the reserve exactly: on the H200, AutoTP at internlm2_20b_shapes, tp=2, 4 and 8, trimmed and not, the
replay equals every rank's `torch.cuda.memory_reserved()` after init to the byte. The untrimmed runs reserve
0.19-0.24 GiB more than their tensors: each layer's RoPE tables (two 8 MiB tensors) take a 20 MiB segment.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Iterable

MIN_BLOCK = 512
SMALL_REQUEST = 1 << 20  # the largest request served from the small pool
SMALL_SEGMENT = 2 << 20
LARGE_SEGMENT = 20 << 20  # for requests between SMALL_REQUEST and MIN_OWN_SEGMENT
MIN_OWN_SEGMENT = 10 << 20  # from here a request gets a segment of its own, rounded up to ROUND_LARGE
ROUND_LARGE = 2 << 20


@dataclass
class Reserve:
    reserved: int  # bytes taken from the driver (torch.cuda.memory_reserved)
    allocated: int  # bytes of the blocks handed out (torch.cuda.memory_allocated): requests rounded, unsplit tails


def round_request(n: int) -> int:
    return MIN_BLOCK * max(1, -(-n // MIN_BLOCK))


def segment_for(n: int) -> int:
    if n <= SMALL_REQUEST:
        return SMALL_SEGMENT
    if n < MIN_OWN_SEGMENT:
        return LARGE_SEGMENT
    return ROUND_LARGE * -(-n // ROUND_LARGE)


def splits_off(tail: int, small: bool) -> bool:
    """Whether what a request leaves of its block becomes a free block of its own (else it stays with the block)."""
    return tail >= MIN_BLOCK if small else tail > SMALL_REQUEST


def replay(sizes: Iterable[int], expandable: bool = False) -> Reserve:
    """The allocator's reserve after these allocations, made in this order and none freed (sizes <= 0 skipped).

    expandable (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True): each pool is one segment that maps 2 MiB pages
    as it grows, so nothing is left in half-used segments: the reserve is the requests rounded, then to 2 MiB
    pages per pool."""
    if expandable:
        return _replay_expandable(sizes)
    free: dict = {True: [], False: []}  # small pool?: sorted free block sizes
    reserved = allocated = 0
    for size in sizes:
        if size <= 0:
            continue
        n = round_request(size)
        small = n <= SMALL_REQUEST
        pool = free[small]
        i = bisect.bisect_left(pool, n)
        if i < len(pool):
            block = pool.pop(i)
        else:
            block = segment_for(n)
            reserved += block
        tail = block - n
        if splits_off(tail, small):
            bisect.insort(pool, tail)
            allocated += n
        else:
            allocated += block
    return Reserve(reserved, allocated)


def _replay_expandable(sizes: Iterable[int]) -> Reserve:
    pools = {True: 0, False: 0}  # small pool?: bytes of its requests, rounded
    for size in sizes:
        if size > 0:
            n = round_request(size)
            pools[n <= SMALL_REQUEST] += n
    reserved = sum(ROUND_LARGE * -(-b // ROUND_LARGE) for b in pools.values())
    return Reserve(reserved, sum(pools.values()))
