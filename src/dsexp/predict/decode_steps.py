"""A long generate's events built from three short ones: its decode steps repeat.

A greedy generate of n new tokens makes the prefill's events, then one block of events per decode step, then a tail
(the frees as generate returns). From a few steps on, each step makes the same requests in the same order as the
step before it, each size grown by the same bytes (the KV cache one position longer), and frees what the step
before it made where that one freed what the step before it had made; what it frees of the prefill's it frees by
the same key. So traces at `FIRST`, `FIRST + 1` and `FIRST + 2` new tokens (events keyed by their allocation's
position, dsexp.predict.meta_trace.numbered) give every longer generate's events: the third trace, its last step
repeated with its keys and sizes moved on, and its tail moved on as many steps. On the meta device a decode step of
a 20B model takes about 0.3 s to trace, so 256 new tokens took minutes per traced batch; built, milliseconds.
dsexp.predict.fragmentation checks the steps once against a trace at `CHECK` new tokens and traces every length
where they do not match.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dsexp.predict.meta_trace import Event

FIRST = 4  # the shortest of the three traces: the steps from here on repeat (the first steps free the prefill's)
CHECK = FIRST + 4  # the length the built events are checked against once, two steps past the third trace
Move = Tuple[bool, int]  # an event's key moves with the steps (a free of what a later step made), its size's growth


@dataclass(frozen=True)
class Steps:
    """The events of the generate of `FIRST + 2` new tokens (`head`: up to and with its last step, `block`; then
    `tail`), and how each event of the block and the tail moves per step."""

    head: Tuple[Event, ...]
    block: Tuple[Event, ...]
    tail: Tuple[Event, ...]
    block_moves: Tuple[Move, ...]
    tail_moves: Tuple[Move, ...]

    def at(self, new: int) -> List[Event]:
        """The events of a generate of `new` (>= FIRST + 2) tokens."""
        more = new - FIRST - 2
        out = list(self.head)
        for step in range(1, more + 1):
            out += moved(self.block, self.block_moves, step, len(self.block))
        return out + moved(self.tail, self.tail_moves, more, len(self.block))


def moved(events: Sequence[Event], moves: Sequence[Move], steps: int, size: int) -> List[Event]:
    """`events` as they are `steps` decode steps (of `size` events) later: an allocation's key is its position, so
    it moves; a free moves where it frees what a step made."""
    return [
        (kind, key + steps * size if kind == "alloc" or follows else key, n + steps * grows)
        for (kind, key, n), (follows, grows) in zip(events, moves)
    ]


def steps_of(shorter: List[Event], short: List[Event], longer: List[Event]) -> Optional[Steps]:
    """The repeating step of three traces one new token apart (None where they do not show one: the longer two not
    the shorter two's events with one block of events inserted where the generate loops, or the inserted blocks or
    the tails differing in kind, or in keys other than by one step)."""
    size = len(short) - len(shorter)
    if size <= 0 or len(longer) - len(short) != size:
        return None
    at = common_prefix(shorter, short)
    if common_prefix(short, longer) != at + size:
        return None
    block_moves = moves(short[at : at + size], longer[at + size : at + 2 * size], size)
    tail_moves = moves(short[at + size :], longer[at + 2 * size :], size)
    if block_moves is None or tail_moves is None:
        return None
    block, tail = longer[at + size : at + 2 * size], longer[at + 2 * size :]
    return Steps(tuple(longer[: at + 2 * size]), tuple(block), tuple(tail), block_moves, tail_moves)


def common_prefix(a: Sequence[Event], b: Sequence[Event]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def moves(before: Sequence[Event], after: Sequence[Event], size: int) -> Optional[Tuple[Move, ...]]:
    """How each event moved one step on (None: the kinds differ, or a key moved other than by 0 or one step); the
    two are of one length (steps_of slices them so)."""
    out = []
    for (kind, key, n), (kind_after, key_after, n_after) in zip(before, after):
        shift = key_after - key
        if kind != kind_after or shift not in ((size,) if kind == "alloc" else (0, size)):
            return None
        out.append((shift == size, n_after - n))
    return tuple(out)
