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
# implement aten.transpose.int fails in the first forward
_TRANSPOSE = (
    "AutoTP's LinearLayer/LinearAllreduce multiply by weight.transpose(-1, -2), and torchao's {cls} does not "
    "implement aten.transpose.int (NotImplementedError in the first forward); AutoTP shards first and quantizes "
    "after, so the order cannot help"
)
AUTOTP_REFUSALS = {
    "int8_weight": _TRANSPOSE.format(cls="Int8Tensor"),  # results/cpu/quant_compose
    "int4_weight": _TRANSPOSE.format(cls="Int4TilePackedTo4dTensor"),  # results/h200/quant/tp2 (an H100)
}


def torchao_member(key: str, **traits) -> QuantTraits:
    """A torchao member's traits: what all of them share (the library, the version gate, ZeRO-3's refusal and
    AutoTP's where its tensor lacks the transpose) around the member's own."""
    return QuantTraits(key, library=TORCHAO, refuses={**ZERO3_REFUSALS}, autotp_problem=AUTOTP_REFUSALS.get(key),
                       gate=TORCHAO_GATE, **traits)  # fmt: skip
