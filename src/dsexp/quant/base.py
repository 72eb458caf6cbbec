"""The quantization family's interface (`quant=` group): what a member declares of itself, on the standard library and
dsexp.core alone.

A member is one folder, dsexp/quant/<key>/, selected by conf/quant/<key>.yaml:
- `__init__.py`: TRAITS, a QuantTraits: what it is, the library call it makes, where it runs (devices, compute
  capability), which engines it composes with and, where it does not, why (the upstream error or issue) and the
  nearest member that does;
- its rank code and memory rule are the library's (dsexp.quant.torchao_rank, dsexp.quant.deepspeed_rank on ranks;
  dsexp.quant.placement in the memory model), chosen by `library` and parametrised by the traits.
The KV cache (`quant.kv`) is the folder dsexp/quant/kv/. The family imports the standard library and dsexp.core only,
as the engines and trims do; an engine's traits are handed in by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional, Tuple

from dsexp.core.gates import VersionGate

STREAM, AFTER = "stream", "after"  # quant.order: as the weights reach the device, or after the engine placed them
EACH, END = "each", "end"  # quant.empty_cache: after each linear is quantized, or once after the phase
EMPTY_CACHE = (EACH, END)


@dataclass(frozen=True)
class Storage:
    """How one quantized linear weight of out x in elements is stored: `bits` per element, plus per scale group
    `per_group` values of `scale_bytes` each (scale, zero-point) where a group is `group` elements of a row (0: a
    whole row; the run dtype's bytes where scale_bytes is None, as DeepSpeed keeps its scales)."""

    bits: int
    scale_bytes: Optional[int]
    group: int = 0  # elements per scale along a row; 0: one scale per row
    per_group: int = 1  # values kept per group of scale_bytes each (DeepSpeed: a scale and a minimum)
    pad_out: int = 1  # rows padded to a multiple of this (torchao's int4 tile packing: 8)
    pad_in: int = 1  # columns padded to a multiple of this (its kernel's k tiles: 1024)

    def nbytes(self, out: int, inp: int, dtype_bytes: int, group: Optional[int] = None) -> int:
        out, inp = _up(out, self.pad_out), _up(inp, self.pad_in)
        g = group or self.group or inp
        scales = out * -(-inp // g)
        per_scale = dtype_bytes if self.scale_bytes is None else self.scale_bytes
        return out * inp * self.bits // 8 + scales * per_scale * self.per_group

    def parts(self, out: int, inp: int, dtype_bytes: int, group: Optional[int] = None) -> Tuple[int, int]:
        """(values, scales) in bytes: the two allocations a quantized weight makes (its scales and zero-points
        together), which the caching allocator places apart (a row's scales fall in its small pool)."""
        total = self.nbytes(out, inp, dtype_bytes, group)
        values = _up(out, self.pad_out) * _up(inp, self.pad_in) * self.bits // 8
        return values, total - values


def _up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class QuantTraits:
    key: str  # quant=<key>
    library: str  # "torchao" | "deepspeed": whose rank code and memory rule apply
    call: str  # the library call, as a user would write it
    summary: str
    storage: Storage
    quality_tol: float  # the first-step logits' relative error against tp=1 unquantized a correct run may show
    devices: Tuple[str, ...] = ("cpu", "cuda")
    min_capability: Optional[Tuple[int, int]] = None  # a GPU's compute capability it needs
    # engine name -> why it does not compose (the upstream error or issue); an engine not named composes
    refuses: Dict[str, str] = field(default_factory=dict)
    # AutoTP's sharded linears (init_inference at tp > 1): None composes, else why not
    autotp_problem: Optional[str] = None
    # why AutoTP's products with this member's weights run as F.linear (dsexp.quant.autotp_linear); "": as AutoTP
    # has them
    autotp_linear: str = ""
    nearest: str = "fp8_weight"  # the member to suggest where this one does not compose
    orders: Tuple[str, ...] = (STREAM, AFTER)  # the orders it can run in; the first is quant.order=auto's
    device_why: str = ""  # why a device it does not list cannot run it
    gate: Optional[VersionGate] = None
    # the elements a product's output may hold: a kernel that indexes it in 32 bits faults past it; None: no limit
    max_output_elements: Optional[int] = None
    max_output_why: str = ""
    # what a forward makes of the stored weight: "dequantize" (a run-dtype copy of one weight at a time, or the
    # gathered layer for DeepSpeed's), "fp8" (products in fp8, the input quantized), "packed" (a kernel that reads
    # the packed weight: tinygemm's int4)
    forward: str = "dequantize"

    def engine_problem(self, engine: str, autotp: bool) -> Optional[str]:
        """Why this member cannot run under `engine` (autotp: the engine shards the linears with AutoTP's modules);
        None: it composes."""
        if engine in self.refuses:
            return f"quant={self.key} with engine={engine}: {self.refuses[engine]}"
        if autotp and self.autotp_problem:
            return f"quant={self.key} with AutoTP's sharded linears: {self.autotp_problem}"
        return None

    def device_problem(self, device: str, capability: Optional[Tuple[int, int]]) -> Optional[str]:
        """Why this member cannot run on `device` ("cpu"/"cuda", with the GPU's compute capability if known)."""
        if device not in self.devices:
            return f"quant={self.key} does not run on device={device}: {self.device_why}"
        if device == "cuda" and self.min_capability and capability and tuple(capability) < self.min_capability:
            need = ".".join(map(str, self.min_capability))
            have = ".".join(map(str, capability))
            return f"quant={self.key} needs a GPU of compute capability >= {need} (this one: {have}): {self.device_why}"
        return None
