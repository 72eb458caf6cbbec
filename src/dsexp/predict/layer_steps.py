"""A deep model's generate built from a trace of four of its decoder layers: its identical layers repeat.

A decoder-only model runs the same layer code on every layer of a forward, so a generate's events in one layer are
those of the layer before it: the same requests in the same order, of the same sizes, and frees of the same
relations (a temporary of the layer, the layer before's output, the layer's own KV cache of the forward before).
The generate is traced on the model cut to `TEMPLATE` layers (the first, one of the middle, the one before the last,
the last: each layer's forward start and end marked, dsexp.predict.meta_trace.marks) and built for all of them: each
layer of the middle as the template's middle one, each free moved with its layer, and where the code outside the
layers frees what a middle layer made (the KV cache as the generate returns) the same frees for every middle layer in
turn. dsexp.predict.fragmentation checks the build once per model, prompt and logits against a trace of `CHECK`
layers, event for event, and traces whole where it differs. A model whose layers differ (their modules, tensors or
settings: sliding-window layers among full ones, MoE among dense) or are not one list of the config's length is
traced whole. On the meta device a decoder layer of a 20B model takes about 5 ms a forward to trace once each op's
kernel ran once (meta_trace), so a generate of 48 layers took seconds; built from four, a tenth of that."""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dsexp.predict.meta_trace import Event
from dsexp.predict.structure import attributes, described, hooks, tensors

TEMPLATE = 4  # layers traced: the first, one of the middle, the one before the last, the last
CHECK = TEMPLATE + 1  # layers of the trace the build is checked against once: two in the middle
# ("out", forward) | ("layer", forward, layer) | ("gap", forward, layer): after the layer, before the next one
Region = Tuple


def decoder_layers(model) -> Optional[Tuple[object, str]]:
    """(The module holding the decoder layers, its attribute) where the model's layers are one list of the config's
    num_hidden_layers, more than CHECK, all alike but for their index (`layer_signature`) and of one layer type; else
    None."""
    import torch.nn as nn

    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or count <= CHECK or len(set(getattr(config, "layer_types", None) or [0])) > 1:
        return None
    found = [
        (parent, name)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.ModuleList) and len(child) == count
    ]
    if len(found) != 1:
        return None
    layers = getattr(*found[0])
    signatures = [layer_signature(m) for m in layers]
    index = {
        k for k, v in signatures[1].items() if type(v) is int and all(s.get(k) == i for i, s in enumerate(signatures))
    }
    alike = [{k: v for k, v in s.items() if k not in index} for s in signatures]
    return found[0] if all(s == alike[0] for s in alike) else None


def layer_signature(layer) -> dict:
    """What the generate's events depend on in one layer, by (module, what): dsexp.predict.structure's
    fingerprint of its modules (class, tensors, hooks, each plain setting apart: the one that is the layer's index
    is left out by decoder_layers)."""
    out: dict = {}
    for name, m in layer.named_modules():
        out[(name, "class")] = described(type(m))
        out[(name, "tensors")] = tensors(m)
        out[(name, "hooks")] = hooks(m)
        out.update({(name, k): v for k, v in attributes(m)})
    return out


@contextlib.contextmanager
def cut(model, stack: Tuple[object, str], layers: int) -> Iterator[Sequence]:
    """The model with its first `layers` decoder layers only (its config says so too), while in the block; yields
    them."""
    import torch.nn as nn

    parent, name = stack
    whole, config = getattr(parent, name), model.config
    saved = {k: getattr(config, k) for k in ("num_hidden_layers", "layer_types") if getattr(config, k, None)}
    parent._modules[name] = nn.ModuleList(list(whole)[:layers])
    config.num_hidden_layers = layers
    if "layer_types" in saved:
        config.layer_types = saved["layer_types"][:layers]
    try:
        yield parent._modules[name]
    finally:
        parent._modules[name] = whole
        for k, v in saved.items():
            setattr(config, k, v)


def traced(trace: Callable, model, stack, layers: int, batch: int, prompt: int, new: int, **extra) -> List[Event]:
    """`trace` (meta_trace.generate_events) of the model cut to `layers`, each layer's start and end marked."""
    with cut(model, stack, layers) as kept:
        return trace(model, batch, prompt, new, marked=kept, **extra)


def regions(events: Sequence[Event], layers: int) -> List[Tuple[str, int, int, Region]]:
    """The events without the marks, each with its region: outside the layers (before the first forward's first
    layer, then after each forward's last: the head, sampling, the next forward's embedding), inside layer l of
    forward f, or in the gap after it before the next."""
    out, region, forward = [], ("out", 0), -1
    for kind, key, n in events:
        if kind == "start":
            forward += key == 0
            region = ("layer", forward, key)
        elif kind == "end":
            region = ("gap", forward, key) if key < layers - 1 else ("out", forward + 1)
        else:
            out.append((kind, key, n, region))
    return out


def template_of(region: Region, layers: int) -> Region:
    """The region of the TEMPLATE-layer trace that stands for `region` of a model of `layers`: the first layer for
    the first, the last ones for the last ones, the template's second for each in the middle (a gap as the layer it
    follows)."""
    if region[0] == "out":
        return region
    kind, forward, i = region
    count, template = (layers, TEMPLATE) if kind == "layer" else (layers - 1, TEMPLATE - 1)
    tail = TEMPLATE - 2  # the template's layers that stand for the model's last ones
    return (kind, forward, i if i < 1 else i - count + template if i >= count - tail else 1)


def stood_for(region: Region, layers: int) -> List[Region]:
    """The regions of a model of `layers` that a template region stands for, last first (as a cache is freed)."""
    if region[0] == "out":
        return [region]
    kind, forward, _ = region
    regions = [(kind, forward, i) for i in range(layers - (kind == "gap"))]
    return [r for r in regions if template_of(r, layers) == region][::-1]


_PLANS: dict = {}  # (a template's kinds and keys, layers) -> its build as columns, sizes by template event, or None
MEMO = 64


def built(template: Sequence[Event], layers: int) -> Optional[List[Event]]:
    """The events of the model of `layers` from its trace cut to TEMPLATE layers (marked), numbered as
    meta_trace.numbered numbers a trace; None where a free does not move with its layer (a relation the template
    cannot carry over) or is of nothing live. Consecutive frees outside the layers of what a middle layer made are
    made for each middle layer in turn (its keys, then its values).

    What the build does depends on the template's kinds and keys alone (its sizes are carried over as they are): it
    runs once per such template and number of layers (`planned`: each event's kind, key and the template event its
    size is from), and a template of other sizes (the next batch's) takes its sizes through that plan at once."""
    import numpy as np

    if not template:
        return planned(template, layers)
    kinds, keys, sizes = zip(*template)
    shape = (kinds, keys, layers)
    if shape not in _PLANS:
        if len(_PLANS) >= MEMO:
            _PLANS.clear()
        plan = planned([(k, key, i) for i, (k, key) in enumerate(zip(kinds, keys))], layers)
        if plan is not None:
            out_kinds, out_keys, source = zip(*plan) if plan else ((), (), ())
            frees = np.array([k != "alloc" for k in out_kinds], dtype=bool)
            plan = (out_kinds, out_keys, np.array(source, dtype=np.int64), frees)
        _PLANS[shape] = plan
    plan = _PLANS[shape]
    if plan is None:
        return None
    out_kinds, out_keys, source, frees = plan
    taken = np.array(sizes, dtype=np.int64)[source]
    taken[frees] = 0
    return list(zip(out_kinds, out_keys, taken.tolist()))


def planned(template: Sequence[Event], layers: int) -> Optional[List[Event]]:
    """`built`'s events, made event by event."""
    where: Dict[int, Tuple[Region, int]] = {}  # the template's allocation -> (its region, its place among the region's)
    by_region: Dict[Region, list] = {}
    made: Dict[Region, int] = {}
    for kind, key, n, region in regions(template, TEMPLATE):
        if kind == "alloc":
            where[key] = (region, made.get(region, 0))
            made[region] = made.get(region, 0) + 1
        by_region.setdefault(region, []).append((kind, key, n))
    out: List[Event] = []
    live: Dict[tuple, int] = {}  # (region, place) -> its allocation's position in `out`
    moves: Dict[tuple, Optional[List[Region]]] = {}
    for region in order(by_region, layers):
        source, count, frees = template_of(region, layers), 0, []
        for kind, key, n in by_region.get(source, ()):
            if kind == "alloc":
                if frees and not freed(frees, out, live):
                    return None
                live[(region, count)] = len(out)
                out.append(("alloc", len(out), n))
                count += 1
                continue
            target, place = where[key]
            if (region, target) not in moves:
                moves[(region, target)] = moved_region(region, source, target, layers)
            moved = moves[(region, target)]
            if moved is None:
                return None
            if frees and frees[-1][0] != moved and not freed(frees, out, live):
                return None
            frees.append((moved, place))
        if frees and not freed(frees, out, live):
            return None
    return out


def freed(frees: list, out: List[Event], live: Dict[tuple, int]) -> bool:
    """Consecutive frees of one (or several) regions' allocations added to `out`, region by region; False where one
    is of nothing live. `frees` is emptied."""
    for region in frees[0][0]:
        for _, place in frees:
            at = live.pop((region, place), None)
            if at is None:
                return False
            out.append(("free", at, 0))
    frees.clear()
    return True


def order(by_region: Dict[Region, list], layers: int) -> List[Region]:
    """The regions of the model of `layers` in the order its generate passes them."""
    forwards = 1 + max((r[1] for r in by_region if r[0] != "out"), default=-1)
    out: List[Region] = []
    for f in range(forwards):
        out.append(("out", f))
        for layer in range(layers):
            out.append(("layer", f, layer))
            if layer < layers - 1:
                out.append(("gap", f, layer))
    return out + [("out", forwards)]


def moved_region(region: Region, source: Region, target: Region, layers: int) -> Optional[List[Region]]:
    """Where a free in `region` (standing in for the template's `source`) of what the template made in `target`
    lands: outside the layers where it was; from a layer, the same steps of layers away (None where there is no such
    layer: the template's middle layer frees what the first one made, a middle one of a deeper model what the one
    before it made; the layers are alike, and the check holds it); from outside, every region `target` stands
    for."""
    if target[0] == "out":
        return [target]
    if region[0] == "out":
        return stood_for(target, layers)
    landed = (target[0], target[1], region[2] + target[2] - source[2])
    return [landed] if 0 <= landed[2] < layers - (landed[0] == "gap") else None


def renumbered(events: List[Tuple[str, tuple, int]]) -> Optional[List[Event]]:
    """Allocations keyed by their position (meta_trace.numbered); None where a free is of nothing made or live."""
    at: Dict[tuple, int] = {}
    out: List[Event] = []
    for i, (kind, key, n) in enumerate(events):
        if kind == "alloc":
            at[key] = i
            out.append((kind, i, n))
        elif key in at:
            out.append((kind, at.pop(key), n))
        else:
            return None
    return out


def unmarked(events: Sequence[Event]) -> Optional[List[Event]]:
    """A marked trace as it would be without its marks (the allocations keyed by their position among the rest)."""
    return renumbered([e for e in events if e[0] in ("alloc", "free")])
