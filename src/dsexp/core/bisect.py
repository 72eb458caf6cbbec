"""The batch search inside one load: which batch a job runs next, from what its points measured so far.

A budget search hands each of dsexp's own jobs a range of batches and the memory model's guess
(`generate.bisect_from`); the ranks load the model once and run points until the largest batch that ran and the
smallest that ran out of memory are neighbours in the range (dsexp.rank.workloads.pipeline). Every rank computes the
same next batch from the same outcomes (the ranks agree on each out-of-memory point before moving on,
dsexp.rank.oom_agreement), so no message is needed to choose it.

The order: the guess; then, while only points that ran are known, up from it (guess+1, +2, +4, +8: where the guess
was right, one run above it settles the bracket, and one batch under costs one point more); while only out-of-memory
points are known, the same downwards; then plain bisection between the two. Where the guess holds within one batch
the job runs 2 or 3 points: the guess, one above, and one below only if the guess ran out of memory.
"""

from __future__ import annotations

import bisect
from typing import Any, Dict, Iterable, List, Optional, Tuple

from dsexp.core.workload import Point, as_list

OK, OOM = "ok", "oom"


def bracket(batches: List[int], outcomes: Dict[int, str]) -> Tuple[int, int]:
    """(index of the largest batch that ran below the smallest that ran out of memory, index of that smallest); -1 and
    len(batches) where nothing is known on that side. `batches` ascending: each outcome's batch found by bisection
    (a plan's replay searches 4096 batches)."""
    hi = min((i for i in map(index_of(batches), (b for b, o in outcomes.items() if o == OOM)) if i >= 0),
             default=len(batches))  # fmt: skip
    last = index_of(batches, last=True)
    lo = max((i for i in map(last, (b for b, o in outcomes.items() if o == OK)) if 0 <= i < hi), default=-1)
    return lo, hi


def index_of(batches: List[int], last: bool = False):
    """batch -> the index of its first (or last) place in the ascending `batches`, -1 where it is not there."""

    def find(b) -> int:
        i = (bisect.bisect_right(batches, b) - 1) if last else bisect.bisect_left(batches, b)
        return i if 0 <= i < len(batches) and batches[i] == b else -1

    return find


def nearest(batches: List[int], start: int) -> int:
    """The index of the batch nearest `start` in the ascending `batches`, the smaller one on a tie (its first
    place)."""
    j = bisect.bisect_left(batches, start)
    if j == len(batches) or (j > 0 and start - batches[j - 1] <= batches[j] - start):
        j = bisect.bisect_left(batches, batches[j - 1])
    return j


def next_batch(batches: List[int], start: int, outcomes: Dict[int, str]) -> Optional[int]:
    """The batch to run next (None: settled), `batches` ascending, `start` the first guess (clamped into the range),
    `outcomes` batch -> ok | oom for the points run so far (any other status counts as not run)."""
    if not batches:
        return None
    s = nearest(batches, start)
    lo, hi = bracket(batches, outcomes)
    if lo == -1 and hi == len(batches):
        return batches[s]
    if hi - lo <= 1:
        return None
    if hi == len(batches):  # only ran so far: up, the step doubling from the guess
        return batches[min(len(batches) - 1, lo + max(lo - s, 1))]
    if lo == -1:  # only out of memory so far: down, likewise
        return batches[max(0, hi - max(s - hi, 1))]
    return batches[(lo + hi) // 2]


def outcomes_of(entries: Iterable[dict]) -> Dict[int, str]:
    """batch -> ok | oom from rank records' point entries (the points not run are left out)."""
    return {int(e["batch"]): e["status"] for e in entries if e.get("status") in (OK, OOM)}


def next_point(generate: Any, entries: Iterable[dict]) -> Optional[Point]:
    """The next point of a GenerateConfig's batch search (generate.bisect_from) after the point entries recorded so
    far, this launch's and earlier ones' (None: settled)."""
    batches = sorted({int(b) for b in as_list(generate.batch_size)})
    (length,) = as_list(generate.prompt_tokens)
    batch = next_batch(batches, generate.bisect_from, outcomes_of(entries))
    return None if batch is None else Point(batch, length)
