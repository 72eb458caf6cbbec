"""What the torchao members share in their traits: the version they were measured with and where they do not
compose, each with the error the run gave (results/cpu/quant_compose.md, GPU: results/h200/quant)."""

from __future__ import annotations

from dsexp.core.gates import VersionGate
from dsexp.quant.base import QuantTraits

TORCHAO = "torchao"
TORCHAO_GATE = VersionGate(TORCHAO, "0.18", "dsexp's torchao members use torchao 0.18's config classes")

_ZERO3 = (
    "ZeRO-3 keeps each parameter as a flat partition and gathers it into a plain tensor for every forward; "
    "torchao's quantized weights are tensor subclasses it cannot partition or gather"
)
ZERO3_REFUSALS = {"zero_inference": _ZERO3, "autotp_zero3": _ZERO3}

# AutoTP's LinearLayer / LinearAllreduce multiply by `weight.transpose(-1, -2)`; a torchao tensor that does not
# implement aten.transpose.int failed in the first forward (NotImplementedError), and dsexp runs that product as
# F.linear (dsexp.quant.autotp_linear)
_TRANSPOSE = (
    "AutoTP's LinearLayer/LinearAllreduce multiply by weight.transpose(-1, -2), which torchao's {cls} does not "
    "implement (aten.transpose.int: NotImplementedError in the first forward, {where}); dsexp runs that product as "
    "F.linear(input, weight), which it does, inside AutoTP's own forward"
)
AUTOTP_LINEAR = {
    "int8_weight": _TRANSPOSE.format(cls="Int8Tensor", where="results/cpu/quant_compose"),
    "int4_weight": _TRANSPOSE.format(cls="Int4TilePackedTo4dTensor", where="results/h200/quant/tp2, an H100"),
}


def torchao_member(key: str, **traits) -> QuantTraits:
    """A torchao member's traits: what all of them share (the library, the version gate, ZeRO-3's refusal and
    AutoTP's F.linear where its tensor lacks the transpose) around the member's own."""
    return QuantTraits(key, library=TORCHAO, refuses={**ZERO3_REFUSALS}, autotp_linear=AUTOTP_LINEAR.get(key, ""),
                       gate=TORCHAO_GATE, **traits)  # fmt: skip
