"""trim.last_logits on a rank: the output head keeps the last position of its input (imported on ranks only)."""

from __future__ import annotations

from dsexp.trims.last_logits import keep_last_logits

__all__ = ["keep_last_logits"]  # defined with the trim's traits: the memory model's trace hooks the head the same way
