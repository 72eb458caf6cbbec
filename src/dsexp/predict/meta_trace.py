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

Most of a trace's time was torch's own meta kernels (Python decompositions, about 0.3 ms an op), run again for every
decoder layer on the same shapes. On the meta device an op's output is a function of its inputs' shapes, strides and
dtypes and its other arguments alone (there is no data), so an op that makes new tensors and changes none of its
inputs (its schema says so) runs its kernel once per such key: later calls get empty tensors of the shapes, strides
and dtypes it made (`Outputs`), each a new storage recorded as the kernel's would be. Views, in-place ops and any
argument the key cannot hold run the kernel every time.
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
            key = dispatch_key(func, args, kwargs)
            known = _OUTPUTS.get(key) if key is not None else None
            kernel = stand_in(func) or func
            out = known.made() if known else kernel(*args, **(kwargs or {}))
            value = scalar(func, args, self.values)
            if value is not None and isinstance(out, torch.Tensor) and out.dim() == 0:
                self.values[out.untyped_storage()._cdata] = value
            if known:  # new tensors, none an input's
                for t in (out,) if isinstance(out, torch.Tensor) else out:
                    self.made(t.untyped_storage(), ())
                return out
            given = {t.untyped_storage()._cdata for t in tensors_in((args, kwargs))}
            for t in tensors_in(out):
                self.made(t.untyped_storage(), given)
            if key is not None and key not in _OUTPUTS:
                remember_outputs(key, out, given)
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


def stand_in(func):
    """A meta kernel of dsexp's own where torch's cannot run on a plain meta tensor (None: torch's)."""
    import torch

    if func is torch.ops.aten._weight_int4pack_mm.default:
        return int4pack_mm
    return None


def int4pack_mm(x, w, group_size, scale_and_zero):
    """tinygemm's int4 product (torchao's int4_weight forward): its output, x's rows by the packed weight's n (its first
    dimension x 8). torch's meta kernel reads `w.fake_device`, which only a FakeTensor has."""
    return x.new_empty((x.size(0), w.size(0) * 8))


_OUTPUTS: dict = {}  # dispatch_key -> Outputs: what the op's meta kernel made for inputs of that key (None: run it)
_MAKES_NEW: dict = {}  # op -> whether its schema makes new tensors only and changes no input
MAX_OUTPUTS = 200_000


def tensors_in(value) -> Iterator:
    """The tensors in an op's arguments or outputs (tensors, lists and tuples of them, a dict of keyword
    arguments)."""
    import torch

    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from tensors_in(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from tensors_in(v)


def makes_new(func) -> bool:
    """Whether the op's schema returns only tensors that alias nothing and mutates no argument."""
    import torch

    if func not in _MAKES_NEW:
        schema = func._schema
        returns = schema.returns
        _MAKES_NEW[func] = (
            bool(returns)
            and not schema.is_mutable
            and all(r.alias_info is None and isinstance(r.type, torch._C.TensorType) for r in returns)
        )
    return _MAKES_NEW[func]


def dispatch_key(func, args, kwargs) -> Any:
    """What the op's meta output depends on: the op, every tensor's shape, strides, offset, dtype and device, every
    other argument with its type (1 and 1.0 promote differently); None where an argument is of another kind or the
    op is not one `makes_new` accepts."""
    if not makes_new(func):
        return None
    try:
        return (func, described_args(args), described_args(tuple(sorted((kwargs or {}).items()))))
    except TypeError:
        return None


_PLAIN_ARGS = (bool, int, float, str, type(None))


def plain_arg_types() -> tuple:
    import torch

    return (*_PLAIN_ARGS, torch.dtype, torch.device, torch.layout, torch.memory_format)


def described_args(values) -> tuple:
    import torch

    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            if type(v) not in (torch.Tensor, torch.nn.Parameter) or v.layout != torch.strided:
                raise TypeError(type(v))
            out.append((v.shape, v.stride(), v.storage_offset(), v.dtype, v.device))
        elif isinstance(v, (tuple, list)):
            out.append((type(v), described_args(v)))
        elif isinstance(v, plain_arg_types()):
            out.append((type(v), v))
        else:
            raise TypeError(type(v))
    return tuple(out)


class Outputs:
    """The tensors an op's meta kernel made (shape, strides, dtype), to make again empty."""

    def __init__(self, tensors, single: bool):
        self.specs = [(tuple(t.shape), t.stride(), t.dtype) for t in tensors]
        self.single = single

    def made(self):
        import torch

        out = [torch.empty_strided(shape, stride, dtype=dtype, device="meta") for shape, stride, dtype in self.specs]
        return out[0] if self.single else tuple(out)


def remember_outputs(key, out, given) -> None:
    """Keep what the kernel made where `Outputs` makes it again exactly: plain meta tensors, each a new storage of
    its own at offset 0, of the bytes an empty tensor of that shape and strides has."""
    import torch

    if len(_OUTPUTS) >= MAX_OUTPUTS:
        _OUTPUTS.clear()
    _OUTPUTS[key] = None  # the kernel runs every time (an output it does not make anew, as _unsafe_view's)
    single = isinstance(out, torch.Tensor)
    tensors = [out] if single else list(out) if isinstance(out, tuple) else []
    if not tensors or not all(type(t) is torch.Tensor and t.device.type == "meta" for t in tensors):
        return
    storages = {t.untyped_storage()._cdata for t in tensors}
    if len(storages) != len(tensors) or storages & given or any(t.storage_offset() or t.requires_grad for t in tensors):
        return
    again = Outputs(tensors, single)
    remade = [again.made()] if single else list(again.made())
    if [t.untyped_storage().nbytes() for t in remade] == [t.untyped_storage().nbytes() for t in tensors]:
        _OUTPUTS[key] = again


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


def generate_events(model, batch: int, prompt_tokens: int, new_tokens: int, marked=(), **extra: Any):
    """The allocation events of one greedy generate of `batch` x `prompt_tokens` + `new_tokens` on a meta model
    (`extra`: generate's other arguments, output_logits=True for one), numbered: the same generate gives the same
    events. `marked`: modules (a model's decoder layers) whose forward's start and end are events too, ("start", i,
    0) and ("end", i, 0) for the i-th (dsexp.predict.layer_steps)."""
    import torch

    ids = torch.zeros((batch, prompt_tokens), dtype=torch.long, device="meta")
    rec = recorder()()
    with marks(marked, rec.events), fused_attention(), exactly(model, new_tokens), rec, torch.no_grad():
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


@contextlib.contextmanager
def marks(modules, events: List[Event]) -> Iterator[None]:
    """Each module's forward, the i-th of `modules`, adds ("start", i, 0) to `events` as it starts and ("end", i, 0)
    as it returns."""
    handles = []
    for i, module in enumerate(modules):
        handles.append(module.register_forward_pre_hook(lambda *_, i=i: events.append(("start", i, 0))))
        handles.append(module.register_forward_hook(lambda *_, i=i: events.append(("end", i, 0))))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def numbered(events: List[Event]) -> List[Event]:
    """The events keyed by their allocation's position among them: a storage's address is no key two traces share.
    Marks (`marks`) stay as they are."""
    at: dict = {}
    out: List[Event] = []
    for i, (kind, key, n) in enumerate(events):
        if kind == "alloc":
            at[key] = i
        out.append((kind, i if kind == "alloc" else at.pop(key) if kind == "free" else key, n))
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
