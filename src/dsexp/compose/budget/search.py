"""The budget search as a pure function of its state: which batches of which configurations to run next.

State: the budget (device bytes per GPU, host bytes), the batches of the range, and per configuration of the space the
memory model's device need at every batch of the range (busiest rank, what lives outside the allocator included) and
the points measured so far. Nothing here runs, reads files or imports Hydra: dsexp.compose.budget.sweeper does that.

Per configuration of dsexp's own workload (budget.one_load, the default): one job whose ranks load the model once and
search the batch themselves from the model's guess (dsexp.core.bisect: the guess, one above, one below only if the
guess ran out of memory, then bisection); a second job only where the first ended before its search settled, over
the batches still open. Otherwise (a user's script, whose job runs one batch, or budget.one_load=false): first the
model's largest batch b and the next one (one job: two runs; a script runs b alone and b + 1 in the next job); then a
bisection
on what was measured (an out-of-memory point is the upper boundary) until the largest batch that ran and the smallest
that did not are one step apart. A probe is the model's guess (shifted by the measured gap) where the run bound still
holds in the worst case after it, else the midpoint; the midpoint too while only out-of-memory points are known (they
bound the need from below, not by how much): at most ceil(log2(len(batches))) + 2 runs per configuration.

The model is a floor (dsexp.predict: it never sits above a measurement it claims to bound), so a batch it says does
not fit bounds the bisection from above before anything ran there: the search plans within the batches up to the
first such one and measures that one itself (floor_cap). The cap is dropped where a measured point came in below its
prediction, or the capped batch ran: the model is then not a floor there, and the whole range is bisected.

Feedback: a point measured above its prediction (or out of memory where the model said it fits) gives its
configuration a gap; every later guess of that configuration, and the first guess of each configuration that differs
from it in one dimension and has no measurement of its own, adds the gap to the model's need.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Tuple

OK, OOM, FAILED = "ok", "oom", "failed"
OVER = "over"  # ran, but its measured need passed the budget (memory outside a capped allocator, or no cap)
LIMIT = "limit"  # never run: past the quant member's kernel limit (int4's 2^31 output elements), a crash not an OOM
PAST = (OOM, OVER, LIMIT)  # the points past the budget: the upper side of the bracket


@dataclass
class Point:
    """One batch of one configuration, run: ok (with the busiest rank's device peak), oom, over (ran, measured past
    the budget), or failed otherwise."""

    batch: int
    status: str
    peak: Optional[int] = None  # measured device bytes, busiest rank (ok points)
    job: Optional[str] = None  # the job folder that ran it
    first: bool = True  # its load's first point: what a fresh process meets (a later one can fit where that does not)


@dataclass
class Miss:
    """Why a configuration is predicted not to fit at the smallest batch: the term whose bytes carry the need past
    the budget, the need and the budget (GPU count for `gpus`, bytes for the others)."""

    term: str
    need: float
    budget: float
    where: str = "device"  # device | host | gpus (counts) | tokens (kernel injection's max_out_tokens)

    @property
    def over(self) -> float:
        return self.need - self.budget


@dataclass
class Config:
    key: str  # its overrides, joined
    dims: Dict[str, str]  # its coordinates in the space (dimension -> value)
    needs: List[int]  # the model's device need at each batch of the range (busiest rank)
    gpus: int = 1  # GPUs it takes (its tp): fewer is better at equal batch
    one_batch: bool = False  # a job runs one batch (a user's script: its {batch_size}), never a grid in one load
    one_load: bool = False  # a job searches the batch itself, inside one load (dsexp.core.bisect)
    miss: Optional[Miss] = None  # predicted not to fit at all: never launched
    replayed: Optional[int] = None  # index of the largest batch the allocator's replay fits (None: not replayed)
    points: List[Point] = field(default_factory=list)
    failed: Optional[str] = None  # a run failed for another cause than memory, or init is foreseen to: not pursued
    twin_of: Optional[str] = None  # the configuration it repeats with expandable segments (allocator_decided)
    confirm_margin: int = 0  # bytes: an answer closer to the budget must have run as a load's first point (0: never)

    def point(self, batch: int) -> Optional[Point]:
        return next((p for p in self.points if p.batch == batch and p.status in (OK, *PAST)), None)


@dataclass
class Job:
    """What a configuration's next job runs: its batches, and where its search inside the load starts (None: it runs
    every batch)."""

    batches: List[int]
    start: Optional[int] = None


@dataclass
class State:
    device: int  # bytes one GPU of the budget holds
    batches: List[int]
    configs: List[Config]
    host: Optional[int] = None

    def to_dict(self) -> Dict:
        return asdict(self)


def batch_range(lo: int, hi: int, step: int) -> List[int]:
    return list(range(lo, hi + 1, step))


def run_bound(n: int) -> int:
    """Runs a configuration may take over a range of n batches."""
    return math.ceil(math.log2(max(n, 1))) + 2


def _bisections(unknown: int) -> int:
    """Probes a plain bisection needs to settle `unknown` batches between two known ones."""
    return math.ceil(math.log2(unknown + 1)) if unknown > 0 else 0


def runs_used(c: Config) -> int:
    return len(c.points)


def loads_used(c: Config) -> int:
    """Jobs (model loads) that measured a point of c."""
    return len({p.job for p in c.points}) if c.points else 0


def bracket(c: Config, batches: List[int]) -> Tuple[int, int]:
    """(index of the largest batch that ran below the smallest that did not, index of that smallest); -1 and
    len(batches) where nothing is known on that side."""
    index = {b: i for i, b in enumerate(batches)}
    ooms = [index[p.batch] for p in c.points if p.status in PAST and p.batch in index]
    hi = min(ooms, default=len(batches))
    oks = [index[p.batch] for p in c.points if p.status == OK and p.batch in index and index[p.batch] < hi]
    return max(oks, default=-1), hi


def own_gap(c: Config, batches: List[int], device: int) -> Optional[int]:
    """How far the model fell short on this configuration's measured points (None: nothing measured); only
    shortfalls count (a prediction is a floor). An out-of-memory point the model said fits needed at least the
    budget: its gap is at least budget - prediction."""
    index = {b: i for i, b in enumerate(batches)}
    gaps = []
    for p in c.points:
        if p.batch not in index:
            continue
        predicted = c.needs[index[p.batch]]
        if p.status in (OK, OVER) and p.peak is not None:
            gaps.append(p.peak - predicted)
        elif p.status == OOM:
            gaps.append(device - predicted + 1)
    return max(0, max(gaps)) if gaps else None


def neighbours(c: Config, configs: List[Config]) -> List[Config]:
    """Configurations that differ from c in exactly one dimension."""
    return [
        o
        for o in configs
        if o is not c and o.dims.keys() == c.dims.keys() and sum(o.dims[k] != c.dims[k] for k in c.dims) == 1
    ]


def gap(c: Config, s: State) -> int:
    """The shift added to c's predictions: its own measured gap, else the largest of its neighbours' (none where
    c's guess is held to the allocator's replay: a neighbour's gap is mostly the fragmentation the replay already
    counts, and adding it again put the guess batches under the boundary)."""
    mine = own_gap(c, s.batches, s.device)
    if mine is not None:
        return mine
    if c.replayed is not None:
        return 0
    theirs = [own_gap(o, s.batches, s.device) for o in neighbours(c, s.configs)]
    return max((g for g in theirs if g is not None), default=0)


def model_largest(c: Config, device: int, shift: int = 0) -> int:
    """Index of the largest batch the model (shifted) says fits, no larger than the allocator's replay; -1 if none."""
    fits = [i for i, need in enumerate(c.needs) if need + shift <= device and (c.replayed is None or i <= c.replayed)]
    return max(fits, default=-1)


def calibrated(c: Config) -> bool:
    """Whether a point of c ran with a measured peak: only then does the measured gap say how far the model is off."""
    return any(p.status in (OK, OVER) and p.peak is not None for p in c.points)


def floor_cap(c: Config, s: State) -> int:
    """Index of the first batch above the largest that ran whose predicted need (unshifted: a floor) passes the budget:
    the batch the bisection plans up to and measures; len(batches) where there is none, or where a measured point
    shows the model is not a floor for c (a peak below its prediction, or the capped batch itself ran)."""
    n = len(s.batches)
    index = {b: i for i, b in enumerate(s.batches)}
    ran = [p for p in c.points if p.status == OK and p.batch in index]
    if any(p.peak is not None and p.peak < c.needs[index[p.batch]] for p in ran):
        return n
    lo, _ = bracket(c, s.batches)
    cap = next((i for i in range(lo + 1, n) if c.needs[i] > s.device), n)
    return n if any(index[p.batch] >= cap for p in ran) else cap


def done(c: Config, s: State) -> bool:
    if c.miss is not None or c.failed is not None:
        return True
    if (loads_used(c) if c.one_load else runs_used(c)) >= run_bound(len(s.batches)):
        return True
    lo, hi = bracket(c, s.batches)
    return hi - lo == 1 and fresh_answer(c, s) if c.points else False


def fresh_answer(c: Config, s: State) -> bool:
    """Whether c's largest batch that ran stands for a fresh process: it ran as a load's first point, or with at
    least `confirm_margin` bytes left under the budget. A process's first generate reserves more than a later one of
    the same batch: at 4 x 19 GiB batch 7 ran as a load's fourth point, 0.17 GiB under the budget, and ran out of
    memory as a first (results/h200/budget/gpu19_tp4_*). Otherwise the answer runs again, first in a fresh load; a
    first point that runs out moves the bracket down."""
    lo, _ = bracket(c, s.batches)
    if not c.confirm_margin or lo < 0:
        return True
    ran = [p for p in c.points if p.batch == s.batches[lo] and p.status == OK]
    peaks = [p.peak for p in ran]
    return any(p.first for p in ran) or (None not in peaks and s.device - max(peaks) >= c.confirm_margin)


def adds_to(c: Config, p: Point) -> bool:
    """Whether a measured point is new to c: a batch not measured yet, or one measured after other points of its
    load run again first (fresh_answer's confirmation: both count, and a first that ran out of memory decides)."""
    same = [q for q in c.points if q.batch == p.batch and q.status in (OK, *PAST)]
    return not same or (p.first and not any(q.first for q in same))


def next_job(c: Config, s: State) -> Optional[Job]:
    """c's next job (None: settled): the batch search inside one load over the batches still open, from the model's
    guess, or the batches a job per guess runs."""
    if done(c, s):
        return None
    if not c.one_load:
        return Job(next_batches(c, s))
    lo, hi = bracket(c, s.batches)
    if hi - lo == 1:  # settled but for its answer, which ran after another point: that batch alone, first
        return Job([s.batches[lo]], s.batches[lo])
    top = min(hi, floor_cap(c, s) + 1)  # the floor's first miss is measured, the batches above it are not planned
    guess = model_largest(c, s.device, gap(c, s))
    if not calibrated(c) and sum(p.status == OOM and p.first for p in c.points) > 1:
        guess = (lo + hi) // 2  # the shifted guess ran out of memory again as a load's first point: bisect, not walk
        # down a batch a load (fp8 on the H100 at 60 GiB: 59, 58, 57, 56, 55; next_batches says why)
    return Job(s.batches[lo + 1 : top], s.batches[min(max(guess, lo + 1), top - 1)])


def next_batches(c: Config, s: State) -> List[int]:
    """The batches c's next job runs (one load; ascending, so a point out of memory comes last); [] when settled."""
    if done(c, s):
        return []
    n, b = len(s.batches), s.batches
    guess = model_largest(c, s.device, gap(c, s))
    lo, hi = bracket(c, b)
    if all(p.status == LIMIT for p in c.points):  # nothing ran yet: the model's guess and the batch above it
        g = min(max(guess, 0), hi - 1)  # (never at or past a kernel's limit)
        return [b[g], b[g + 1]] if g + 1 < min(n, hi) and not c.one_batch else [b[g]]
    hi = min(hi, floor_cap(c, s) + 1)  # past the floor's first miss: planned as out of memory, not measured
    left = run_bound(n) - runs_used(c)
    if not calibrated(c):
        # only out-of-memory points: they say the need passed the budget, not by how much (on the H200 the allocator's
        # fragmentation put 7.9 GiB out of reach at 40 GiB), so the model shifted by "just over" walked down one batch
        # a job (16, 15, 14, 13 ran out of memory). Bisect until a point that ran gives a measured gap.
        return [b[(lo + hi) // 2]]
    m = min(max(guess, lo + 1), hi - 1)

    def affordable(probes: List[int]) -> bool:
        worst = max(probes[0] - lo - 1, hi - probes[-1] - 1)
        return len(probes) + _bisections(worst) <= left

    if m + 1 < hi and not c.one_batch and affordable([m, m + 1]):
        return [b[m], b[m + 1]]
    if affordable([m]):
        return [b[m]]
    return [b[(lo + hi) // 2]]


def benefit(c: Config, s: State) -> Tuple:
    """Sort key, best first: the largest batch the model (with the measured gap) says fits, then fewer GPUs, then the
    lower need there."""
    i = model_largest(c, s.device, gap(c, s))
    return (-i, c.gpus, c.needs[i] if i >= 0 else math.inf, c.key)


def next_round(s: State, width: int = 1) -> List[Tuple[Config, Job]]:
    """The next `width` jobs: the configurations still open, in order of predicted benefit, each with its job."""
    out = []
    for c in sorted((c for c in s.configs if not done(c, s)), key=lambda c: benefit(c, s)):
        todo = next_job(c, s)
        if todo and todo.batches:
            out.append((c, todo))
        if len(out) >= width:
            break
    return out


def allocator_decided(c: Config, s: State) -> bool:
    """Whether the caching allocator, not the bytes, set c's settled bracket: its first batch past the budget ran out
    of memory although the model's allocated bytes (with what lives outside the allocator) fit the budget there, so
    its cached blocks were too small for a request (fragmentation), which expandable segments avoid."""
    if not done(c, s) or c.miss is not None or c.failed is not None:
        return False
    _, hi = bracket(c, s.batches)
    return (
        hi < len(s.batches)
        and c.needs[hi] <= s.device
        and any(p.status == OOM and p.batch == s.batches[hi] for p in c.points)
    )


def largest_ok(c: Config, batches: List[int]) -> Optional[int]:
    """The largest batch that ran below the first out-of-memory one (None: none ran)."""
    lo, _ = bracket(c, batches)
    return batches[lo] if lo >= 0 else None


def first_failing_term(terms: Dict[str, int], budget: int) -> Optional[Tuple[str, int]]:
    """Adding the terms in order, the first whose bytes carry the total past the budget, and the total's overshoot
    (None: they fit)."""
    total = 0
    for name, value in terms.items():
        total += value
        if total > budget:
            return name, sum(terms.values()) - budget
    return None
