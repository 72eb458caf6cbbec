"""The allocations a generate makes, in order, with their frees, traced on the meta device: no GPU, no real memory.

The model is built on the meta device (predict.architecture) and transformers' own `generate` runs on it as dsexp's
ranks call it (greedy, min_new_tokens = new tokens; dsexp.rank.generation.call_generate) under a dispatch mode that
records every new storage an op makes (its bytes) and, through a finaliser on that storage, the moment it is freed:
the order the caching allocator sees on a GPU. What the meta device cannot say is supplied where a GPU differs:
- data-dependent scalars read as dsexp's prompts make them on a GPU (`scalar`): unpadded and unpacked, so a check
  that every position is a token (`.all()`, transformers' `fast_all`: a bool tensor's sum equal to its size) is true
  and generate drops the all-ones mask and SDPA attends causally, grouped-query heads unrepeated, as on the H200;
  any other check (`.any()` of a pad or stop token, `.item()`) reads False / 0, and the loop runs exactly the new
  tokens (its stop check counted, as min_new_tokens makes it on a GPU);
- `scaled_dot_product_attention` has no fused kernel on meta (it decomposes into the scores): on a GPU the fused
  kernel allocates its output and, for inference, no log-sum-exp (the H200's own events of a Llama generate show a
  256-byte one and the output: results/h200/fragmentation), so the output is recorded;
- cuBLAS's workspace is not a generate's: the fragmentation replay holds it from before the generate, as the H200
  did.
The events replay through dsexp.predict.allocator.Allocator after the weights' own allocations.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator, List, Tuple

from dsexp.core.workload import GREEDY

Event = Tuple[str, int, int]  # ("alloc", key, bytes) | ("free", key, 0)


def recorder():
    """A TorchDispatchMode that records storages as they are made and freed (`.events`)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.events: List[Event] = []
            self.live: dict = {}
            self.values: dict = {}  # a 0-dim result's storage -> the value dsexp's inputs give it on a GPU

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:  # no data on meta: the value a GPU would read
                default = False if args[0].dtype == torch.bool else 0
                return self.values.get(args[0].untyped_storage()._cdata, default)
            out = func(*args, **(kwargs or {}))
            value = scalar(func, args, self.values)
            if value is not None and isinstance(out, torch.Tensor) and out.dim() == 0:
                self.values[out.untyped_storage()._cdata] = value
            given = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.made(t.untyped_storage(), given)
            return out

        def made(self, storage, given) -> None:
            key = storage._cdata
            if key in self.live or key in given:  # a view or an in-place result: no new memory
                return
            self.live[key] = storage.nbytes()
            self.events.append(("alloc", key, storage.nbytes()))
            weakref.finalize(storage, self.freed, key)

        def freed(self, key: int) -> None:
            self.values.pop(key, None)
            if self.live.pop(key, None) is not None:
                self.events.append(("free", key, 0))

    return Recorder


def scalar(func, args, values: dict) -> Any:
    """The value a 0-dim result has for unpadded, unpacked prompts (None: not known; read as False / 0): `.all()` of
    a mask or a positions check true, a bool tensor's sum its size (transformers' `fast_all`), equality of a known
    value with a number."""
    import torch

    name = str(func)
    if name.startswith("aten.all."):
        return True
    if name == "aten.sum.default" and args[0].dtype == torch.bool:
        return args[0].numel()
    if name == "aten.eq.Scalar" and isinstance(args[0], torch.Tensor):
        known = values.get(args[0].untyped_storage()._cdata)
        return None if known is None else known == args[1]
    return None


@contextlib.contextmanager
def fused_attention() -> Iterator[None]:
    """scaled_dot_product_attention as a GPU's fused kernels allocate it without gradients: the output."""
    import torch
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention

    def fused(q, k, v, *args, **kwargs):
        if v.shape[-1] == q.shape[-1]:  # laid out as the query is (a kernel writes its heads where q has them)
            return torch.empty_like(q)
        return torch.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype, device=q.device)

    F.scaled_dot_product_attention = fused
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def exactly(model, steps: int) -> Iterator[None]:
    """generate's loop runs `steps` times (its stop check reads no data on meta)."""
    cls = type(model)
    original = cls._has_unfinished_sequences
    count = [0]

    def unfinished(self, *args: Any, **kwargs: Any) -> bool:
        count[0] += 1
        return count[0] <= steps

    cls._has_unfinished_sequences = unfinished
    try:
        yield
    finally:
        cls._has_unfinished_sequences = original


def generate_events(model, batch: int, prompt_tokens: int, new_tokens: int, **extra: Any):
    """The allocation events of one greedy generate of `batch` x `prompt_tokens` + `new_tokens` on a meta model
    (`extra`: generate's other arguments, output_logits=True for one), numbered: the same generate gives the same
    events."""
    import torch

    ids = torch.zeros((batch, prompt_tokens), dtype=torch.long, device="meta")
    rec = recorder()()
    with fused_attention(), exactly(model, new_tokens), rec, torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            **GREEDY,
            **extra,
        )
        del out
    return numbered(rec.events)


def numbered(events: List[Event]) -> List[Event]:
    """The events keyed by their allocation's position among them: a storage's address is no key two traces share."""
    at: dict = {}
    out: List[Event] = []
    for i, (kind, key, n) in enumerate(events):
        if kind == "alloc":
            at[key] = i
        out.append((kind, i if kind == "alloc" else at.pop(key), n))
    return out


def live_peak(events: List[Event]) -> int:
    """The most bytes the events hold at once (their own bytes, before any allocator's rounding)."""
    sizes, live, peak = {}, 0, 0
    for kind, key, n in events:
        if kind == "alloc":
            sizes[key] = n
            live += n
            peak = max(peak, live)
        else:
            live -= sizes.pop(key, 0)
    return peak
