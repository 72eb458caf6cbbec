"""dsexp: reproduce, measure and explain multi-GPU DeepSpeed inference memory."""

__version__ = "0.1.0"
