"""What the trims' rank-side code shares (imported on ranks only)."""

from __future__ import annotations


def nbytes(t) -> int:
    return t.numel() * t.element_size()


def empty_cache(device_type: str) -> None:
    """Give the allocator's freed blocks back to the device, so that the rank's readings show what a trim removed."""
    if device_type == "cuda":
        import torch

        torch.cuda.empty_cache()
