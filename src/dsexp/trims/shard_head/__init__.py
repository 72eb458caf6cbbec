"""trim.shard_head: DeepSpeed's AutoTP splits the output head whatever its attribute name (LmHeadLinearAllreduce:
weight split on the hidden dim, partial logits all-reduced).

AutoTP splits a top-level head only if it is named `lm_head` or `embed_out` (module_inject/replace_module.py
`set_lm_head`). rank.py registers the head also as `lm_head` while `init_inference` runs (the same module under two
names: the checkpoint loader still finds `output.weight`), then puts DeepSpeed's replacement back under the head's own
name. placement.py: the head AutoTP then splits.
"""

from __future__ import annotations

from dsexp.core.gates import VersionGate
from dsexp.trims.base import TrimTraits

TRAITS = TrimTraits(
    "shard_head",
    short="head",
    summary="init_inference AutoTP: split the output head whatever its name (LmHeadLinearAllreduce)",
    autotp_only=True,
    changes_slices=True,
    gate=VersionGate(
        "deepspeed",
        "0.15",
        "DeepSpeed 0.14 splits a head (set_lm_head) only when init_inference loads a checkpoint: measured on 0.14.4, "
        "the alias changes nothing on an eager load",
    ),
)
HEAD_NAMES = ("lm_head", "embed_out")  # the names DeepSpeed's set_lm_head looks for
