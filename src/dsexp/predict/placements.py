"""What every placement rule speaks (dsexp.engines.<name>.placement, dsexp.trims.<key>.placement): the settings that
decide placement (Strategy), the model's tensors as the engine holds them (Tensor), where each one lies on each rank
(Placement), and the cuts (replicated, split, even, chunks)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Tuple

from dsexp.predict import architecture as arch


@dataclass
class Placement:
    name: str
    full: int  # bytes of the whole tensor, in the dtype the engine holds it
    local: Tuple[int, ...]  # bytes on each rank's compute device
    how: str  # "replicated", "offloaded" or the splitting module/style (LinearLayer, zero3, colwise...)
    dim: Optional[int] = None  # the dimension a TP split cuts (0: each rank's rows are contiguous in the file)
    is_buffer: bool = False
    copy: bool = False  # a tensor the engine makes that is not in the model (AutoTP's clone of a tied head)
    # per rank, the allocations its bytes are made of where they are several (a quantized weight's values and scales)
    parts: Tuple[Tuple[int, ...], ...] = ()
    # per rank, the bytes in the run dtype where a quant member restated `local` at its width: the cut the engine made
    run_local: Tuple[int, ...] = ()
    run_full: int = 0  # the same for `full`: the whole tensor in the run dtype, as the checkpoint holds it
    first: bool = False  # quantized before the other linears (the output head with quant.head_first)


@dataclass
class Strategy:
    """The settings that decide placement (everything but tp)."""

    engine: str
    kernel_inject: bool
    policy: Optional[Dict[str, List[str]]]
    zero_stage: int
    offload: str
    dtype: str
    model_dtype: str
    load: str
    fmt: str
    device: str
    max_out_tokens: int
    conversion: Optional[str]
    restore_buffers: bool = True  # the loader puts back the non-persistent buffers the engine cast (their dtype)
    trims: Dict[str, bool] = field(default_factory=dict)  # trim.<key>: true (dsexp.trims.MODEL_TRIMS)
    deepspeed: Optional[str] = None  # the version the ranks ran (a stack's), None: this environment's
    transformers: Optional[str] = None  # the same for transformers
    # The engine's traits the model reads (dsexp.engines.base.EngineTraits), filled by whoever builds the strategy:
    casts_buffers: bool = False  # the whole module, buffers included, cast to the run dtype
    splits_weights: bool = False  # each rank keeps its slice of the weights and its own KV heads
    expandable_segments: bool = False  # PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (trim.env, script.fix)
    last_position_logits: bool = False  # a trim has the head compute the last position's logits only
    # quant= (dsexp.quant), filled by the rules: the weight member, its group, what its forward dequantizes ("layer":
    # one weight of the rank at a time; "gathered": ZeRO-3 gathers a whole weight first; None: nothing), and the KV
    # cache's bits (None: the run dtype), group and the tokens it keeps unquantized
    quant: Optional[str] = None
    quant_group: Optional[int] = None
    dequantizes: Optional[str] = None
    quantizes_activations: bool = False  # fp8 products: each linear's input is quantized to fp8 with a scale per row
    kv_bits: Optional[int] = None
    kv_group: int = 64
    kv_residual: int = 128
    # the most elements one product's output may hold under the member's kernel (None: no limit), and why
    quant_max_output: Optional[int] = None
    quant_max_output_why: str = ""
    quant_order: str = "stream"  # the order the member runs in (quant.order resolved) and quant.empty_cache
    quant_empty_cache: str = "each"
    quant_head: bool = False  # torchao's members: the output head quantized too (quant.head)
    quant_head_first: bool = False  # ... before the other linears (quant.head_first, with quant.empty_cache=each)

    def trimmed(self, key: str) -> bool:
        return bool(self.trims.get(key))

    def deepspeed_before(self, *version: int) -> bool:
        from dsexp.core.schema import version_tuple

        return self.deepspeed is not None and version_tuple(self.deepspeed) < version

    def transformers_before(self, *version: int) -> bool:
        from dsexp.core.schema import version_tuple

        return self.transformers is not None and version_tuple(self.transformers) < version


@dataclass
class Tensor:
    """A parameter or buffer of the model, as the engine holds it."""

    name: str
    module: str
    numel: int
    shape: Tuple[int, ...]
    itemsize: int
    is_buffer: bool


def tensors(model, strategy: Strategy) -> List[Tensor]:
    """Every parameter and buffer once (tied weights counted once), in the dtype the engine holds it: a casting
    engine's run dtype, except the non-persistent buffers dsexp puts back as the model built them (RoPE tables,
    with load.restore_buffers)."""
    import torch

    cast = strategy.casts_buffers
    run_itemsize = arch.DTYPE_BYTES[strategy.dtype]
    seen, out = set(), []
    for mname, mod in model.named_modules():
        for is_buffer, items in (
            (False, mod.named_parameters(recurse=False)),
            (True, mod.named_buffers(recurse=False)),
        ):
            for pname, t in items:
                if t is None or id(t) in seen:
                    continue
                seen.add(id(t))
                restored = is_buffer and strategy.restore_buffers and pname in mod._non_persistent_buffers_set
                size = run_itemsize if (cast and not restored and torch.is_floating_point(t)) else t.element_size()
                out.append(
                    Tensor(f"{mname}.{pname}" if mname else pname, mname, t.numel(), tuple(t.shape), size, is_buffer)
                )
    return out


def itemsize(t, s: Strategy) -> int:
    """Bytes per element of a model tensor as the engine holds it (casting engines: floats in the run dtype)."""
    import torch

    return arch.DTYPE_BYTES[s.dtype] if (s.casts_buffers and torch.is_floating_point(t)) else t.element_size()


def replicated(t: Tensor, tp: int, how: str = "replicated") -> Placement:
    b = t.numel * t.itemsize
    return Placement(t.name, b, (b,) * tp, how, is_buffer=t.is_buffer)


def split(t: Tensor, dim: int, sizes: List[int], how: str) -> Placement:
    """A tensor cut along `dim` into pieces of the given sizes (one per rank)."""
    other = t.numel // t.shape[dim]
    return Placement(
        t.name, t.numel * t.itemsize, tuple(s * other * t.itemsize for s in sizes), how, dim=dim, is_buffer=t.is_buffer
    )


def unchanged() -> Dict[str, Dict[str, int]]:
    """No module class removed or added."""
    return {"removed": {}, "added": {}}


def even(n: int, tp: int) -> List[int]:
    return [n // tp + (1 if r < n % tp else 0) for r in range(tp)]


def chunks(n: int, tp: int) -> List[int]:
    """torch.chunk's sizes."""
    size = -(-n // tp)
    return [max(0, min(size, n - r * size)) for r in range(tp)]


class Placer(Protocol):
    """An engine member's `placement.place`: where each of the model's tensors (meta device) lies on each of tp ranks.

    Returns (placements, the module classes the engine removes and adds: {"removed": {}, "added": {}}). Appends to
    `notes` what the prediction assumes, in words; fills `found` with how an AutoTP policy was found. Raises
    AssertionError where DeepSpeed itself refuses (e.g. AutoTP finds no policy)."""

    def __call__(
        self, model: Any, tensors: List[Tensor], s: Strategy, tp: int, notes: List[str], found: Dict[str, Any]
    ) -> Tuple[List[Placement], Dict[str, Dict[str, int]]]: ...
