"""Where a capped GPU runs out of memory: the weights' allocations and a generate's (traced on the meta device,
dsexp.predict.meta_trace), replayed with their frees through the caching allocator (dsexp.predict.allocator.Allocator)
under the cap, default or with expandable segments.

The allocated bytes (dsexp.predict.capacity) say what a batch holds at its peak; the allocator decides whether the
free bytes it holds come in blocks large enough. On the H200 (llama_20b_shapes, tp=1, prompt 2048 + 8 new tokens,
capped at 48 GiB: results/h200/fragmentation) the replay put the last batch that fits at 14 with the default allocator
and 16 with expandable segments, as measured; the allocated bytes alone said 16 for both.

A rank of a tensor-parallel engine is traced on the meta model as that rank holds it (its family's `rank_model`: for
AutoTP the split linears and the heads each module is told it has); an all-reduce allocates nothing on the device.
A point of dsexp's own job makes several generate calls (`point_calls`: warm-up, the measured one, repeats, and at a
job's first point one more of one token with its logits for the correctness check, of the first sequence alone),
replayed in turn. Not traced: what the load itself allocated and freed before the weights settled (the replay places
the weights in the engine's order), the one batch or two the loading strategies differ by under a cap
(docs/FINDINGS.md 6d).

A generate is traced at two batches (2 and 3) and scaled to the others: from batch 2 on it makes the same requests
in the same order, each of a size affine in the batch (batch 1's differ: generate checks several prompts for right
padding, so batch 1 is traced). The scaling is checked once, to the byte, against a trace at the first batch asked
for above both; where the two batches' events differ in kind or order, or the check fails, every batch is traced.
Traces are kept by the model's structure (`fingerprint`), not its identity: the copies of one rank model that two
configurations trace (load=meta and eager of one tp and trim) share them; on 2 x 40 GiB at 20B shapes the 8
configurations' replay traces 12 generates, where it traced one per batch probed in each configuration. A generate
of more than 8 new tokens is likewise built from its repeating decode steps (dsexp.predict.decode_steps), checked
once against a trace of 8; and a generate of a deep model from a trace of four of its decoder layers where they are
alike (dsexp.predict.layer_steps), checked once per model, prompt and logits against a trace of five: at 20B shapes
(48 layers) a configuration's replay traced 13 generates of 48 layers in about a minute on two cores, now 13 of
four in seconds.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass
from functools import cached_property
from typing import Iterator, List, NamedTuple, Optional, Sequence, Tuple

from dsexp.core.bisect import OK, OOM, bracket, next_batch
from dsexp.core.workload import CHECK_BATCH
from dsexp.predict import layer_steps
from dsexp.predict.allocator import Allocator, Replay
from dsexp.predict.capacity import CUBLAS_WORKSPACE
from dsexp.predict.decode_steps import CHECK, FIRST, Steps, steps_of
from dsexp.predict.meta_trace import Event, generate_events
from dsexp.predict.structure import fingerprint


@dataclass
class Probe:
    """One batch replayed: whether it fits the cap, and the allocator's peaks (uncapped where it does not fit; None
    where the search did not ask for them)."""

    batch: int
    fits: bool
    peak_reserved: Optional[int]
    peak_allocated: Optional[int]
    request: Optional[int] = None  # the request that found no room (out of memory)


def apply_order(model, skip: Sequence[int] = ()) -> List[int]:
    """The bytes of each tensor in the order `module.to(device)` / `to_empty` allocates them: children first, then
    each module's own parameters and buffers (tied tensors once; none whose id is in `skip`)."""
    seen, out = set(skip), []

    def walk(module) -> None:
        for child in module.children():
            walk(child)
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t.untyped_storage().nbytes())

    walk(model)
    return out


class Call(NamedTuple):
    """One generate call of a point: `new` tokens, with its logits or not, at `batch` sequences (None: the point's)."""

    new: int
    logits: bool = False
    batch: Optional[int] = None


def point_calls(
    new: int, warmup: int = 0, repeats: int = 1, logits: bool = False, logits_batch: Optional[int] = CHECK_BATCH
) -> List[Call]:
    """The generate calls one point of dsexp's pipeline makes, in order (dsexp.rank.generation.measure_point): the
    logits call at `logits_batch` sequences (None: the point's batch, as jobs made it before the call ran the first
    sequence alone; the committed H200 and H100 budget searches did)."""
    return [Call(new)] * (warmup + max(1, repeats)) + ([Call(1, True, logits_batch)] if logits else [])


def probe(
    model,
    weights: List[int],
    batch: int,
    prompt: int,
    calls: Sequence[Call],
    cap: int,
    expandable: bool = False,
    structure: Optional[str] = None,
    peaks: bool = True,
) -> Probe:
    """Replay the weights, cuBLAS's workspace, then one point's generate calls at `batch` x `prompt`, under `cap`.
    The workspace is held before the generate's first request: so the H200 reserved, to the byte, at batches 13 and
    14 in a process that had run smaller batches and at 14 in a fresh one (results/h200/fragmentation); taken at the
    first product instead, it splits a freed activation's block and the replay reserves 1.1 GiB less. `structure`:
    the model's fingerprint where the caller has it (a search probes one model many times). `peaks`: where the
    batch does not fit, replay it again uncapped for its peaks (a search only asks whether it fits)."""
    structure = structure or fingerprint(model)
    held = weight_events(weights) + [("alloc", "cublas", CUBLAS_WORKSPACE)]
    events = [held] + [replayable(model, at or batch, prompt, new, logits, structure) for new, logits, at in calls]
    capped = replayed(events, cap, expandable)
    if capped.oom is None:
        return Probe(batch, True, capped.peak_reserved, capped.peak_allocated)
    if not peaks:
        return Probe(batch, False, None, None, capped.oom[1])
    free = replayed(events, None, expandable)
    return Probe(batch, False, free.peak_reserved, free.peak_allocated, capped.oom[1])


def weight_events(weights: Sequence) -> List[Event]:
    """The weights as the allocator's events: byte sizes allocated in order, or events as they are (a quantize phase
    that frees the run-dtype weights and empties the cache once at its end: dsexp.quant.on_meta)."""
    if weights and isinstance(weights[0], tuple):
        return list(weights)
    return [("alloc", i, n) for i, n in enumerate(weights)]


def replayed(events: Sequence[Sequence[Event]], cap: Optional[int], expandable: bool) -> Replay:
    """The allocator's figures over the events (Allocator.run_each), its blocks unlinked after (Allocator.close)."""
    allocator = Allocator(cap, expandable)
    try:
        return allocator.run_each(events)
    finally:
        allocator.close()


BASE = 2  # the first of the two batches traced and scaled (batch 1's generate skips a check of several prompts)
_SCALED: dict = {}  # (model's fingerprint, prompt, new, logits) -> Scaled, or None: trace every batch
_TRACES: dict = {}  # (model's fingerprint, prompt, new, logits), batch -> events
_STEPS: dict = {}  # (model's fingerprint, prompt, logits, batch) -> Steps, or None: trace every length
_LAYERED: dict = {}  # (model's fingerprint, prompt, logits) -> whether its layers' build matched a trace
_STACKS: dict = {}  # model's fingerprint -> (the path of the module holding its decoder layers, attribute) or None
_SEARCHES: dict = {}  # largest_batch's arguments (the model by its fingerprint) -> its answer and probes
MEMO = 64


@dataclass(frozen=True)
class Scaled:
    """A generate's events at batch `BASE`, sizes growing by `steps` per batch above it."""

    events: Tuple[Event, ...]
    steps: Tuple[int, ...]

    def at(self, batch: int) -> List[Event]:
        return [(kind, key, n + (batch - BASE) * d) for (kind, key, n), d in zip(self.events, self.steps)]

    def columns(self, batch: int) -> "Columns":
        """The events at `batch` as the allocator reads them (`at`'s, without a tuple made per event): the sizes
        computed at once."""
        kinds, keys, sizes, steps = self._columns
        return Columns(kinds, keys, (sizes + (batch - BASE) * steps).tolist())

    def gives(self, batch: int, events: Sequence[Event]) -> bool:
        """Whether `at(batch)` are these events (compared by columns)."""
        kinds, keys, sizes, steps = self._columns
        theirs = columns_of(events)
        return kinds == theirs[0] and keys == theirs[1] and (sizes + (batch - BASE) * steps).tolist() == list(theirs[2])

    @cached_property
    def _columns(self):
        import numpy as np

        kinds, keys, sizes = zip(*self.events) if self.events else ((), (), ())
        return kinds, keys, np.array(sizes, dtype=np.int64), np.array(self.steps, dtype=np.int64)


class Columns:
    """Events as three columns (kinds, keys, sizes): iterated, the (kind, key, size) of each in order."""

    __slots__ = ("kinds", "keys", "sizes")

    def __init__(self, kinds: Sequence[str], keys: Sequence[int], sizes: Sequence[int]):
        self.kinds, self.keys, self.sizes = kinds, keys, sizes

    def __len__(self) -> int:
        return len(self.kinds)

    def __iter__(self) -> Iterator[Event]:
        return zip(self.kinds, self.keys, self.sizes)


def scaled(base: List[Event], above: List[Event]) -> Optional[Scaled]:
    """The events of batches `BASE` and `BASE + 1` as one sequence with sizes that grow with the batch (None: their
    kinds or keys differ, or a size shrinks). Compared and subtracted by columns (`columns_of`)."""
    import numpy as np

    kinds, keys, sizes = columns_of(base)
    kinds_above, keys_above, sizes_above = columns_of(above)
    if kinds != kinds_above or keys != keys_above:
        return None
    low = np.array(sizes, dtype=np.int64)
    steps = np.array(sizes_above, dtype=np.int64) - low
    if steps.size and steps.min() < 0:
        return None
    scaling = Scaled(tuple(base), tuple(steps.tolist()))
    scaling.__dict__["_columns"] = (kinds, keys, low, steps)  # Scaled._columns, made here already
    return scaling


def columns_of(events: Sequence[Event]) -> Tuple[tuple, tuple, tuple]:
    """(kinds, keys, sizes) of the events."""
    return tuple(zip(*events)) if events else ((), (), ())  # type: ignore[return-value]


def traced(model, batch: int, prompt: int, new: int, logits: bool, structure: Optional[str] = None) -> List[Event]:
    """One generate's events at `batch` on `model`: scaled where its traces scale, else traced at that batch. Both
    allocators and every model of the same structure (load=meta and eager of one tp and trim) replay them."""
    key = (structure or fingerprint(model), prompt, new, logits)
    scaling = scaling_of(model, key, batch)
    return scaling.at(batch) if scaling is not None else trace(model, key, batch)


def replayable(model, batch: int, prompt: int, new: int, logits: bool, structure: Optional[str] = None):
    """`traced`'s events as the allocator replays them: a scaled generate's as `Columns` (no tuple built per
    event)."""
    key = (structure or fingerprint(model), prompt, new, logits)
    scaling = scaling_of(model, key, batch)
    return scaling.columns(batch) if scaling is not None else trace(model, key, batch)


def scaling_of(model, key: tuple, batch: int) -> Optional[Scaled]:
    """The scaling that gives the generate's events at `batch` (None: traced at that batch)."""
    if batch > BASE + 1 and key not in _SCALED:
        remember(_SCALED, key, checked_scaling(model, key, batch))
    return _SCALED.get(key) if batch >= BASE else None


def checked_scaling(model, key: tuple, batch: int) -> Optional[Scaled]:
    """The scaling of traces at `BASE` and `BASE + 1` where it gives exactly the events traced at `batch` (the first
    asked for above both: the batches below it are traced as asked); else None."""
    scaling = scaled(trace(model, key, BASE), trace(model, key, BASE + 1))
    return scaling if scaling is not None and scaling.gives(batch, trace(model, key, batch)) else None


def trace(model, key: tuple, batch: int) -> List[Event]:
    """One generate's events at `batch`: traced, or, longer than decode_steps.CHECK new tokens, built from its
    decode steps where they repeat (dsexp.predict.decode_steps)."""
    if (key, batch) not in _TRACES:
        _, prompt, new, logits = key
        steps = repeating_steps(model, key, batch) if new > CHECK else None
        made = steps.at(new) if steps else generated(model, key, batch)
        remember(_TRACES, (key, batch), made)
    return _TRACES[(key, batch)]


def generated(model, key: tuple, batch: int) -> List[Event]:
    """One generate's events at `batch`: built from a trace of layer_steps.TEMPLATE decoder layers where the model's
    layers repeat and the build matched a trace of layer_steps.CHECK layers (once per model, prompt and logits);
    else traced whole."""
    structure, prompt, new, logits = key
    extra = {"output_logits": True} if logits else {}
    stack = decoder_layers(model, structure)
    memo = (structure, prompt, logits)
    if stack is None or _LAYERED.get(memo) is False:
        return generate_events(model, batch, prompt, new, **extra)
    template = layer_steps.traced(generate_events, model, stack, layer_steps.TEMPLATE, batch, prompt, new, **extra)
    if memo not in _LAYERED:
        check = layer_steps.traced(generate_events, model, stack, layer_steps.CHECK, batch, prompt, new, **extra)
        found = layer_steps.built(template, layer_steps.CHECK)
        remember(_LAYERED, memo, found is not None and found == layer_steps.unmarked(check))
    made = layer_steps.built(template, len(getattr(*stack))) if _LAYERED[memo] else None
    return made if made is not None else generate_events(model, batch, prompt, new, **extra)


def decoder_layers(model, structure: str) -> Optional[Tuple[object, str]]:
    """layer_steps.decoder_layers, found once per structure (the fingerprint holds what it looks at: the config, each
    module's class, tensors, settings and hooks) and kept as the path to the module holding the layers."""
    if structure not in _STACKS:
        found = layer_steps.decoder_layers(model)
        where = None if found is None else next(n for n, m in model.named_modules() if m is found[0])
        remember(_STACKS, structure, None if found is None else (where, found[1]))
    kept = _STACKS[structure]
    return None if kept is None else (model.get_submodule(kept[0]), kept[1])


def repeating_steps(model, key: tuple, batch: int) -> Optional[Steps]:
    """The decode steps of traces at FIRST, FIRST + 1 and FIRST + 2 new tokens where, built to CHECK tokens, they
    give exactly the events traced there; else None (every length traced). Once per model, prompt and batch."""
    structure, prompt, _, logits = key
    memo = (structure, prompt, logits, batch)
    if memo not in _STEPS:
        short = [trace(model, (structure, prompt, n, logits), batch) for n in (FIRST, FIRST + 1, FIRST + 2)]
        found = steps_of(*short)
        if found is not None and found.at(CHECK) != trace(model, (structure, prompt, CHECK, logits), batch):
            found = None
        remember(_STEPS, memo, found)
    return _STEPS[memo]


def remember(memo: dict, key, value) -> None:
    if len(memo) >= MEMO:
        memo.clear()
    memo[key] = value


def largest_batch(
    model,
    weights: List[int],
    prompt: int,
    calls: Sequence[Call],
    cap: int,
    start: int,
    expandable: bool = False,
    top: int = 4096,
    structure: Optional[str] = None,
) -> Tuple[int, List[Probe]]:
    """The largest batch whose replay fits `cap` (0: none), searched from `start` (the allocated bytes' answer:
    fragmentation only lowers it, mostly by a batch or two) as a job searches its batches (dsexp.core.bisect): `start`,
    the batch above, the batches below one by one, then bisection; (batch, the probes made: the peaks of those that
    fit). A search is made once per process for its arguments, the model by its structure: configurations that differ
    only in how the weights are loaded (load=eager, meta, sharded of one tp and trim) place the same weights in the
    same order on a rank model of one structure, so they ask the same search. `structure`: the model's fingerprint
    where the caller has it."""
    structure = structure or fingerprint(model)
    asked = (structure, tuple(weights), prompt, tuple(calls), cap, start, expandable, top)
    if asked not in _SEARCHES:
        with collector_paused():
            made = searched(model, weights, prompt, calls, cap, start, expandable, top, structure)
        remember(_SEARCHES, asked, made)
    found, probes = _SEARCHES[asked]
    return found, list(probes)


@contextlib.contextmanager
def collector_paused():
    """Python's cyclic garbage collector off while in the block (as it was after). A search's replays make hundreds of
    thousands of blocks that link to their neighbours and live through a replay: counted as new long-lived objects,
    they set off full collections, each a walk over every object of the process (torch's, transformers' and the
    traces: 0.3 s and more on two cores, several per search). Off, what they leave in cycles is collected young,
    once, after the search."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def searched(model, weights, prompt, calls, cap, start, expandable, top, structure) -> Tuple[int, List[Probe]]:
    """largest_batch's search, made."""
    batches, outcomes = list(range(1, top + 1)), {}
    probes: List[Probe] = []
    b = next_batch(batches, max(1, min(start, top)), outcomes)
    while b is not None:
        probes.append(probe(model, weights, b, prompt, calls, cap, expandable, structure, peaks=False))
        outcomes[b] = OK if probes[-1].fits else OOM
        b = next_batch(batches, start, outcomes)
    lo, _ = bracket(batches, outcomes)
    return (batches[lo] if lo >= 0 else 0), probes
