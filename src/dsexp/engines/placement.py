"""The engines' and trims' rules in the memory model, dispatched: the engine member's `placement.place`, then the
trims' rules over its placements, and the order the engine allocates in. The memory model (dsexp.predict) knows no
member; whoever predicts a job asks here for the rule (dsexp.analysis.memory)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.engines import ENGINES, part
from dsexp.predict.placements import Placement, Placer, Strategy, Tensor, replicated, tensors, unchanged
from dsexp.predict.weights_per_rank import AllocationOrder
from dsexp.trims.dedupe_buffers import placement as dedupe


def placer(engine: str) -> Placer:
    """The engine member's placement rule; an engine dsexp does not know (a script's) keeps every tensor whole."""
    return part(engine, "placement").place if engine in ENGINES else _unknown_engine


def _unknown_engine(model, held: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]):
    notes.append(f"no placement rule for engine {s.engine!r}: predicted as unsharded")
    return [replicated(t, tp) for t in held], unchanged()


def allocation_order(engine: str) -> Optional[AllocationOrder]:
    """The order the engine puts a rank's tensors on the GPU (the member's `placement.allocation_order`); None where
    it does not say."""
    return getattr(part(engine, "placement"), "allocation_order", None) if engine in ENGINES else None


def place(model, strategy: Strategy, tp: int, shared: Optional[Dict[str, str]] = None, with_policy: bool = False):
    """(placements, predicted module changes, notes, error[, policy]) for any model (meta device) under a strategy.

    shared: with trim.dedupe_buffers, {buffer: the identical buffer it shares} (dsexp.trims.dedupe_buffers.placement);
    each shared one takes no bytes of its own on any rank.
    policy: how AutoTP's policy was found ({"policy", "source", "why", ...}); where DeepSpeed refuses for want of
    one, the policy `engine.injection_policy=infer` would use (so the diagnosis can name it)."""
    held = tensors(model, strategy)
    notes: List[str] = []
    found: Dict[str, Any] = {}
    try:
        placements, modules = placer(strategy.engine)(model, held, strategy, tp, notes, found)
        error = None
    except AssertionError as e:  # DeepSpeed's own refusal (e.g. AutoTP finds no policy)
        if not found:
            from dsexp.models.policy import infer_policy

            found.update(infer_policy(model), suggested=True)
        placements, modules = [replicated(t, tp) for t in held], unchanged()
        error = str(e) or "AssertionError"
    if shared:
        placements = dedupe.share(placements, shared, tp, notes)
    out = (placements, modules, notes, error)
    return (*out, found or None) if with_policy else out


def shared_buffers(source: Dict[str, Any], strategy: Strategy) -> Optional[Dict[str, str]]:
    """With trim.dedupe_buffers on, the buffers that share an identical one; else None."""
    return dedupe.shared_buffers(source, strategy)


def allocator_reserve(placements: List[Placement], rank: int, s: Strategy):
    """The caching allocator's reserve for this rank's weights (a dsexp.predict.allocator.Reserve), replaying the
    engine's allocations in its order; None where the engine does not say its order."""
    from dsexp.predict.allocator import replay

    order = allocation_order(s.engine)
    sizes = order(placements, rank, s) if order else None
    return replay(sizes) if sizes is not None else None
