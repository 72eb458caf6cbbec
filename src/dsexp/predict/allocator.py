"""PyTorch's CUDA caching allocator, replayed: what it reserves for a rank's weights, and for a generate's
allocations with their frees, under a cap (where it runs out of memory while free bytes sit in blocks too small).

The allocator rounds every request to 512 bytes and takes memory from the driver in segments: 2 MiB for requests
up to 1 MiB (the small pool, shared by many), 20 MiB for requests between 1 and 10 MiB (the rest of the segment
serves later requests of that size class), and the request rounded up to 2 MiB above that. A free block is reused
best-fit within its pool and split where more than 1 MiB (large pool) or 512 bytes (small pool) would be left;
otherwise the whole block is handed out. These are the rules of c10's CUDACachingAllocator (unchanged from torch
1.x to 2.11) without `expandable_segments` or `max_split_size_mb`.

Freed blocks return to their pool and merge with free neighbours of their segment. A request that finds no block
and no room under the cap (set_per_process_memory_fraction) makes the allocator free its cached whole segments and
try once more; then it runs out of memory. With `expandable_segments` each pool is one segment of virtual addresses
that maps pages as it grows (2 MiB in the small pool, 20 MiB in the large one, c10's kSmallBuffer / kLargeBuffer) and
unmaps the free pages when it runs out. `Allocator` replays such a sequence (`Event`s).

Nothing is freed while the weights are placed, so replaying the allocations in the order the engine makes them
gives the reserve exactly: on the H200, AutoTP at internlm2_20b_shapes, tp=2, 4 and 8, trimmed and not, the
replay equals every rank's `torch.cuda.memory_reserved()` after init to the byte. The untrimmed runs reserve
0.19-0.24 GiB more than their tensors: each layer's RoPE tables (two 8 MiB tensors) take a 20 MiB segment.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

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


class Block:
    """A stretch of a segment: handed out, or free in its pool (keyed there by `key`: size, then address)."""

    __slots__ = ("addr", "size", "small", "free", "mapped", "prev", "next", "key")

    def __init__(self, addr: int, size: int, small: bool, mapped: bool = True, prev=None, next=None):
        self.addr, self.size, self.small = addr, size, small
        self.free = True
        self.mapped = mapped  # expandable segments: pages behind it (False: address space only)
        self.prev: Optional[Block] = prev
        self.next: Optional[Block] = next
        self.key = 0


class OutOfMemory(Exception):
    def __init__(self, index: int, request: int, state: "Replay"):
        super().__init__(
            f"event {index}: {request} bytes requested with {state.allocated} allocated and "
            f"{state.reserved - state.allocated} reserved but unallocated under a cap of {state.cap}"
        )
        self.index, self.request = index, request


@dataclass
class Replay:
    """The allocator's figures over a replay (bytes)."""

    cap: Optional[int]
    reserved: int = 0
    allocated: int = 0
    peak_reserved: int = 0
    peak_allocated: int = 0
    oom: Optional[Tuple[int, int]] = None  # (event index, bytes requested) where it ran out of memory

    def note(self) -> None:
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        self.peak_allocated = max(self.peak_allocated, self.allocated)


# ("alloc", key, bytes), ("free", key, 0), or ("release", None, 0): torch.cuda.empty_cache() (a quantize phase's end);
# a key is any hashable naming one allocation within its sequence
Event = Tuple[str, Hashable, int]
ROUND = -MIN_BLOCK  # a mask to a multiple of MIN_BLOCK
SIZE_SHIFT = 64  # a free block's key in its pool: its size above its address (below 2**62) above its pool's bit


TOP = 1 << 61  # where the first reservation ends (keys hold addresses below 2**62)
VA_GRANULE = 32 << 20


class Addresses:
    """The driver's virtual addresses for new segments, which decide c10's ties: of two free blocks of one size, the
    lower address is handed out. On the H200 and the H100 (torch 2.11, CUDA 13) cudaMalloc reserves address space in
    32 MiB granules, each reservation below the last, and puts a segment that fits a hole (a reservation's unused
    tail, or a freed segment's range) at the bottom of the lowest such hole: so it placed all 339 segments of a 20B
    bf16 load (results/h200/fragmentation). So a generate's new segments sit below the weights', and the newest of
    several freed activations of one size is the one reused (results/h200/quant/fp8_trace: an fp8 generate's
    reserve to the byte, where increasing addresses reused the oldest and reserved 1.6 GiB less)."""

    def __init__(self):
        self.low = TOP
        self.holes: List[List[int]] = []  # [address, size], by address

    def take(self, size: int) -> int:
        for i, hole in enumerate(self.holes):
            if hole[1] >= size:
                addr = hole[0]
                if hole[1] == size:
                    del self.holes[i]
                else:
                    hole[0], hole[1] = addr + size, hole[1] - size
                return addr
        region = -(-size // VA_GRANULE) * VA_GRANULE
        self.low -= region
        if region > size:
            self.give(self.low + size, region - size)
        return self.low

    def give(self, addr: int, size: int) -> None:
        """A range back to the holes, merged with the holes it touches."""
        i = bisect.bisect_left(self.holes, [addr, 0])
        self.holes.insert(i, [addr, size])
        if i + 1 < len(self.holes) and addr + size == self.holes[i + 1][0]:
            self.holes[i][1] += self.holes.pop(i + 1)[1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == addr:
            self.holes[i - 1][1] += self.holes.pop(i)[1]


class Allocator:
    """c10's CUDACachingAllocator for one stream: best fit within a pool, blocks split and merged, segments from the
    driver (or pages mapped, with expandable segments) under an optional cap. Its figures are `state`.

    Each pool's free blocks are one sorted list of integer keys (size << 64 | address << 1 | small: best fit is the
    first key at or above the request's size, ties to the lowest address, as c10's set of (size, address)) and a dict
    from key to block: a replay makes millions of requests, and comparing integers is what bisect does fastest."""

    def __init__(self, cap: Optional[int] = None, expandable: bool = False):
        self.state = Replay(cap)
        self.expandable = expandable
        self.pools: Dict[bool, List[int]] = {True: [], False: []}  # small?: sorted keys of its free blocks
        self.blocks: Dict[int, Block] = {}  # key -> free block
        self.live: Dict[object, Block] = {}  # an event's id -> its block
        self.addresses = Addresses()  # where the driver puts each new segment
        self.segments: List[Block] = []  # each segment's first block (it stays the first: blocks merge into it)
        self.space: Dict[bool, Block] = {}  # expandable: each pool's segment, from its first block

    @classmethod
    def from_segments(cls, segments: Sequence[Dict], cap: Optional[int] = None) -> "Allocator":
        """An allocator in the state a GPU's snapshot recorded (benchmarks/snapshot_events.py: each segment's address,
        size, pool and blocks as [size, state]): its blocks in place, the allocated ones held (keys ("held", i)),
        new segments below the lowest."""
        al = cls(cap)
        for seg in sorted(segments, key=lambda x: x["address"]):
            addr, prev, small = seg["address"], None, seg["pool"] == "small"
            for size, state in seg["blocks"]:
                block = Block(addr, size, small, True, prev)
                if prev is None:
                    al.segments.append(block)
                else:
                    prev.next = block
                if state == "active_allocated":
                    block.free = False
                    al.live[("held", len(al.live))] = block
                    al.state.allocated += size
                else:
                    al._insert(block)
                prev, addr = block, addr + size
            al.state.reserved += seg["size"]
        al.addresses.low = min((x["address"] for x in segments), default=TOP)
        al.state.note()
        return al

    def malloc(self, size: int, index: int = 0) -> Block:
        n = ((size + MIN_BLOCK - 1) // MIN_BLOCK) * MIN_BLOCK  # round_request
        if n < MIN_BLOCK:
            n = MIN_BLOCK
        small = n <= SMALL_REQUEST
        pool = self.pools[small]
        i = bisect.bisect_left(pool, n << SIZE_SHIFT)  # best fit
        if i < len(pool):
            block = self.blocks.pop(pool.pop(i))
        else:
            block = self._grow(small, n)
            if block is None:
                self._release()
                block = self._best_fit(small, n) or self._grow(small, n)
            if block is None:
                self.state.oom = (index, n)
                raise OutOfMemory(index, n, self.state)
        tail = block.size - n
        if tail >= MIN_BLOCK if small else tail > SMALL_REQUEST:  # splits_off: the tail a free block of its own
            rest = Block(block.addr + n, tail, small, True, block, block.next)
            if block.next is not None:
                block.next.prev = rest
            block.next, block.size = rest, n
            self._insert(rest)
        block.free = False
        state = self.state
        state.allocated += block.size
        if state.allocated > state.peak_allocated:  # state.note(), inline: once an allocation
            state.peak_allocated = state.allocated
        if state.reserved > state.peak_reserved:
            state.peak_reserved = state.reserved
        return block

    def free(self, block: Block) -> None:
        block.free = True
        self.state.allocated -= block.size
        prev, after = block.prev, block.next
        if prev is not None and prev.free and prev.mapped:
            block = self._merge(block, prev)
        if after is not None and after.free and after.mapped:
            block = self._merge(block, after)
        self._insert(block)

    def run(self, events: Iterable[Event], first: int = 0) -> Replay:
        """Replay allocations and frees in order; stops at the first that runs out of memory (state.oom, its index
        counted from `first`). `malloc` and `free` inline (a replay makes millions of each): the same steps."""
        live, blocks, state, expandable = self.live, self.blocks, self.state, self.expandable
        pools, space = self.pools, self.space
        small_pool, large_pool = pools[True], pools[False]
        bisect_left, insort = bisect.bisect_left, bisect.insort
        pop = live.pop
        allocated, peak = state.allocated, state.peak_allocated  # kept here, written back as the loop ends
        for i, (kind, key, size) in enumerate(events, first):
            if kind == "alloc":
                if size <= 0:
                    continue
                n = (size + MIN_BLOCK - 1) & ROUND  # round_request (size > 0)
                small = n <= SMALL_REQUEST
                pool = small_pool if small else large_pool
                try:  # best fit
                    block = blocks.pop(pool.pop(bisect_left(pool, n << SIZE_SHIFT)))
                except IndexError:  # none in the pool
                    state.allocated, state.peak_allocated = allocated, peak
                    block = self._grow(small, n)  # a segment from the driver: the reserve's peak noted there
                    if block is None:
                        self._release()
                        block = self._best_fit(small, n) or self._grow(small, n)
                    if block is None:
                        state.oom = (i, n)
                        break
                tail = block.size - n
                if tail >= MIN_BLOCK if small else tail > SMALL_REQUEST:  # splits_off
                    after = block.next
                    rest = Block(block.addr + n, tail, small, True, block, after)
                    if after is not None:
                        after.prev = rest
                    block.next, block.size = rest, n
                    k = rest.key = tail << SIZE_SHIFT | rest.addr << 1 | small
                    blocks[k] = rest
                    insort(pool, k)
                block.free = False
                live[key] = block
                allocated += block.size
                if allocated > peak:
                    peak = allocated
                continue
            block = pop(key, None)
            if block is None:
                if kind == "release":  # checked here only: a plain free never pays for it
                    self._release()
                continue
            block.free = True
            allocated -= block.size
            # merged with its free neighbours, the one before, then the one after: the two merges are written out
            # rather than called, as malloc and free are, in the replay's hot loop (a plan frees millions of blocks)
            other = block.prev
            if other is not None and other.free and other.mapped:
                k = other.key  # out of its pool (_remove: a free mapped block is in its pool)
                if blocks.pop(k, None) is not None:
                    pool = small_pool if other.small else large_pool
                    del pool[bisect_left(pool, k)]
                other.size += block.size  # _merge, `other` first
                other.next = beyond = block.next
                if beyond is not None:
                    beyond.prev = other
                if expandable and space.get(other.small) is block:
                    space[other.small] = other
                block = other
            other = block.next
            if other is not None and other.free and other.mapped:
                k = other.key
                if blocks.pop(k, None) is not None:
                    pool = small_pool if other.small else large_pool
                    del pool[bisect_left(pool, k)]
                block.size += other.size  # _merge, `block` first
                block.next = beyond = other.next
                if beyond is not None:
                    beyond.prev = block
                if expandable and space.get(block.small) is other:
                    space[block.small] = block
            k = block.key = block.size << SIZE_SHIFT | block.addr << 1 | block.small  # _insert
            blocks[k] = block
            insort(small_pool if block.small else large_pool, k)
        state.allocated, state.peak_allocated = allocated, peak
        return state

    def run_each(self, sequences: Iterable[Sequence[Event]]) -> Replay:
        """Replay each sequence in turn, its keys its own (a free is of an allocation of its sequence; what a
        sequence leaves allocated stays, as one generate's output cache stays through the next); as `run` over
        their events with each key tagged by its sequence, without building that list."""
        first = 0
        for events in sequences:
            self.live = {}
            self.run(events, first)
            if self.state.oom is not None:
                break
            first += len(events)
        return self.state

    def close(self) -> None:
        """Unlink every block from its neighbours: a replay's blocks, linked both ways, are otherwise garbage only
        Python's cycle collector finds (hundreds of thousands a search); unlinked, each goes as the replay is
        dropped. The figures (`state`) stay."""
        for block in [*self.segments, *self.space.values()]:
            while block is not None:
                after = block.next
                block.prev = block.next = None
                block = after
        self.segments, self.space, self.live, self.blocks = [], {}, {}, {}
        self.pools = {True: [], False: []}

    def _best_fit(self, small: bool, n: int) -> Optional[Block]:
        pool = self.pools[small]
        i = bisect.bisect_left(pool, n << SIZE_SHIFT)
        return self.blocks.pop(pool.pop(i)) if i < len(pool) else None

    def _insert(self, block: Block) -> None:
        key = block.key = block.size << SIZE_SHIFT | block.addr << 1 | block.small
        self.blocks[key] = block
        bisect.insort(self.pools[block.small], key)

    def _remove(self, block: Block) -> None:
        key = block.key
        if self.blocks.get(key) is block:
            del self.blocks[key]
            pool = self.pools[block.small]
            del pool[bisect.bisect_left(pool, key)]

    def _fits_cap(self, more: int) -> bool:
        return self.state.cap is None or self.state.reserved + more <= self.state.cap

    def _grow(self, small: bool, n: int) -> Optional[Block]:
        """A new segment from the driver holding the request, or (expandable) pages mapped at the pool's end."""
        if self.expandable:
            return self._map(small, n)
        size = segment_for(n)
        if not self._fits_cap(size):
            return None
        self.state.reserved += size
        self.state.note()
        block = Block(self.addresses.take(size), size, small)
        self.segments.append(block)
        return block

    def _map(self, small: bool, n: int) -> Optional[Block]:
        page = SMALL_SEGMENT if small else LARGE_SEGMENT
        if small not in self.space:
            self.space[small] = Block(0, 1 << 62, small, mapped=False)
        hole, start = self.space[small], None
        while hole is not None:  # the lowest unmapped stretch that, with a free mapped block before it, holds n
            if hole.free and not hole.mapped:
                start = hole.prev if hole.prev is not None and hole.prev.free and hole.prev.mapped else hole
                if hole.size + (start.size if start is not hole else 0) >= n:
                    break
            hole = hole.next
        need = max(0, n - (start.size if start is not hole else 0))
        grow = page * -(-need // page)
        if not self._fits_cap(grow):
            return None
        self.state.reserved += grow
        self.state.note()
        mapped = Block(hole.addr, grow, small, True, hole.prev, hole)
        if hole.prev is not None:
            hole.prev.next = mapped
        hole.prev, hole.addr, hole.size = mapped, hole.addr + grow, hole.size - grow
        if hole is self.space[small]:
            self.space[small] = mapped
        if start is not hole:
            self._remove(start)
            mapped = self._merge(mapped, start)
        return mapped

    def _merge(self, block: Block, other: Block) -> Block:
        """`other` (a free neighbour, out of its pool) folded into `block`."""
        self._remove(other)
        first, second = (block, other) if block.addr < other.addr else (other, block)
        first.size += second.size
        first.next = second.next
        if second.next is not None:
            second.next.prev = first
        if self.expandable and self.space.get(first.small) is second:
            self.space[first.small] = first
        return first

    def _release(self) -> None:
        """What c10 does before it gives up: free cached segments no tensor uses (expandable: unmap free pages)."""
        for small, pool in self.pools.items():
            for key in list(pool):
                block = self.blocks[key]
                if self.expandable:
                    self._unmap(block, SMALL_SEGMENT if small else LARGE_SEGMENT)
                elif block.prev is None and block.next is None:
                    self._remove(block)
                    self.state.reserved -= block.size
                    self.addresses.give(block.addr, block.size)

    def _unmap(self, block: Block, page: int) -> None:
        lo, hi = -(-block.addr // page) * page, (block.addr + block.size) // page * page
        if hi <= lo:
            return
        self._remove(block)
        self.state.reserved -= hi - lo
        pieces = [(block.addr, lo - block.addr, True), (lo, hi - lo, False), (hi, block.addr + block.size - hi, True)]
        prev, after = block.prev, block.next
        made = []
        for addr, size, mapped in pieces:
            if size > 0:
                made.append(Block(addr, size, block.small, mapped=mapped))
        for a, b in zip([prev] + made, made + [after]):
            if a is not None:
                a.next = b
            if b is not None:
                b.prev = a
        for piece in made:
            if piece.mapped:
                self._insert(piece)
        if self.space.get(block.small) is block:
            self.space[block.small] = made[0]
        hole = next(p for p in made if not p.mapped)
        for a, b in ((hole, hole.next), (hole.prev, hole)):  # one unmapped stretch
            if a is not None and b is not None and not a.mapped and not b.mapped and a.free and b.free:
                a.size += b.size
                a.next = b.next
                if b.next is not None:
                    b.next.prev = a
                hole = a


def replay(sizes: Iterable[int], expandable: bool = False) -> Reserve:
    """The allocator's reserve after these allocations, made in this order and none freed (sizes <= 0 skipped)."""
    allocator = Allocator(expandable=expandable)
    state = allocator.run([("alloc", i, s) for i, s in enumerate(sizes)])
    return Reserve(state.reserved, state.allocated)
