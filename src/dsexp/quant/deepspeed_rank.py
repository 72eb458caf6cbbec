"""DeepSpeed's weight-quantization members on a rank: the ds_config block ZeRO-3's zero.Init reads while
from_pretrained builds the model (`weight_quantization.quantized_initialization`), so each nn.Linear and nn.Embedding
weight is quantized as it is loaded, then partitioned. Imported on ranks only."""

from __future__ import annotations

from typing import Any, Dict, Optional

from dsexp.quant.base import QuantTraits


def ds_block(t: QuantTraits, group: Optional[int]) -> Dict[str, Any]:
    """The ds_config entries for the member (group on the last dim, asymmetric: DeepSpeed supports no other)."""
    return {
        "weight_quantization": {
            "quantized_initialization": {
                "num_bits": t.storage.bits,
                "group_size": group or t.storage.group,
                "group_dim": 1,
                "symmetric": False,
            }
        }
    }


def quantized_weights(module) -> Dict[str, Any]:
    """What DeepSpeed quantized: the weights it marked (`weight_quantized`), counted."""
    names = [n for n, p in module.named_parameters() if getattr(p, "weight_quantized", False)]
    return {"weights": len(names), "first": names[:3]}
