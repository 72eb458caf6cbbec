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
job's first point one more of one token with its logits for the correctness check), replayed in turn. Not traced:
what the load itself allocated and freed before the weights settled (the replay places the weights in the engine's
order), the one batch or two the loading strategies differ by under a cap (docs/FINDINGS.md 6d).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

from dsexp.core.bisect import OK, OOM, bracket, next_batch
from dsexp.predict.allocator import Allocator, Replay
from dsexp.predict.capacity import CUBLAS_WORKSPACE
from dsexp.predict.meta_trace import generate_events


@dataclass
class Probe:
    """One batch replayed: whether it fits the cap, and the allocator's peaks (uncapped where it does not fit)."""

    batch: int
    fits: bool
    peak_reserved: int
    peak_allocated: int
    request: Optional[int] = None  # the request that found no room (out of memory)


def apply_order(model) -> List[int]:
    """The bytes of each tensor in the order `module.to(device)` / `to_empty` allocates them: children first, then
    each module's own parameters and buffers (tied tensors once)."""
    seen, out = set(), []

    def walk(module) -> None:
        for child in module.children():
            walk(child)
        for t in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(t) not in seen:
                seen.add(id(t))
                out.append(t.untyped_storage().nbytes())

    walk(model)
    return out


Call = Tuple[int, bool]  # one generate call: (new tokens, output_logits)


def point_calls(new: int, warmup: int = 0, repeats: int = 1, logits: bool = False) -> List[Call]:
    """The generate calls one point of dsexp's pipeline makes, in order (dsexp.rank.generation.measure_point)."""
    return [(new, False)] * (warmup + max(1, repeats)) + ([(1, True)] if logits else [])


def probe(
    model, weights: List[int], batch: int, prompt: int, calls: Sequence[Call], cap: int, expandable: bool = False
) -> Probe:
    """Replay the weights, cuBLAS's workspace, then one point's generate calls at `batch` x `prompt`, under `cap`.
    The workspace is held before the generate's first request: so the H200 reserved, to the byte, at batches 13 and
    14 in a process that had run smaller batches and at 14 in a fresh one (results/h200/fragmentation); taken at the
    first product instead, it splits a freed activation's block and the replay reserves 1.1 GiB less."""
    events = [("alloc", ("w", i), n) for i, n in enumerate(weights)] + [("alloc", "cublas", CUBLAS_WORKSPACE)]
    for i, (new, logits) in enumerate(calls):
        events += [(kind, (i, key), n) for kind, key, n in traced(model, batch, prompt, new, logits)]
    capped: Replay = Allocator(cap, expandable).run(events)
    if capped.oom is None:
        return Probe(batch, True, capped.peak_reserved, capped.peak_allocated)
    free = Allocator(None, expandable).run(events)
    return Probe(batch, False, free.peak_reserved, free.peak_allocated, capped.oom[1])


_TRACES: dict = {}  # (model, batch, prompt, new, logits) -> events: both allocators replay the same generate


def traced(model, batch: int, prompt: int, new: int, logits: bool) -> list:
    key = (id(model), batch, prompt, new, logits)
    if key not in _TRACES:
        if len(_TRACES) > 64:
            _TRACES.clear()
        extra = {"output_logits": True} if logits else {}
        events = generate_events(model, batch, prompt, new, **extra)
        _TRACES[key] = (model, events)  # the model kept with its events: its id stays its own
    return _TRACES[key][1]


def largest_batch(
    model,
    weights: List[int],
    prompt: int,
    calls: Sequence[Call],
    cap: int,
    start: int,
    expandable: bool = False,
    top: int = 4096,
) -> Tuple[int, List[Probe]]:
    """The largest batch whose replay fits `cap` (0: none), searched from `start` (the allocated bytes' answer:
    fragmentation only lowers it, mostly by a batch or two) as a job searches its batches (dsexp.core.bisect): `start`,
    the batch above, the batches below one by one, then bisection; (batch, the probes made)."""
    batches, outcomes = list(range(1, top + 1)), {}
    probes: List[Probe] = []
    b = next_batch(batches, max(1, min(start, top)), outcomes)
    while b is not None:
        probes.append(probe(model, weights, b, prompt, calls, cap, expandable))
        outcomes[b] = OK if probes[-1].fits else OOM
        b = next_batch(batches, start, outcomes)
    lo, _ = bracket(batches, outcomes)
    return (batches[lo] if lo >= 0 else 0), probes
