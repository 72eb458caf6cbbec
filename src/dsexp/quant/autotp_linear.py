"""AutoTP's sharded linears with a torchao weight that has no transpose (int8_weight's Int8Tensor, int4_weight's
Int4TilePackedTo4dTensor). DeepSpeed's LinearLayer, LinearAllreduce and LmHeadLinearAllreduce multiply by
`torch.matmul(input, self.weight.transpose(-1, -2))`, which those tensors refuse (aten.transpose.int); their product
is `F.linear(input, weight)`, which they implement. Inside such a layer's forward, and only there, dsexp answers the
weight's transpose with a marker and the matmul by it with F.linear: DeepSpeed's own forward runs unchanged around
it (its input slice, all-reduce and bias), in every DeepSpeed version that multiplies that way. Imported on ranks."""

from __future__ import annotations

from typing import Any, List

# the layers AutoTP leaves in place of nn.Linear (deepspeed.module_inject.layers), the output head's last
AUTOTP_LINEARS = ("LinearLayer", "LinearAllreduce", "LmHeadLinearAllreduce")
_LAST_TWO = ((-1, -2), (-2, -1))


class TransposedWeight:
    """What `weight.transpose(-1, -2)` returns inside an adapted forward: the weight, to be multiplied as F.linear.
    Tensor-like (it has __torch_function__) so that torch.matmul takes it and the mode below sees the call."""

    def __init__(self, weight) -> None:
        self.weight = weight

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return NotImplemented  # only LinearOfTranspose gives it a meaning


def _mode_class():
    import torch
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    class LinearOfTranspose(TorchFunctionMode):
        """torch.matmul(x, w.transpose(-1, -2)) as F.linear(x, w) for the one weight `w`; every other call as is."""

        def __init__(self, weight) -> None:
            super().__init__()
            self.weight = weight

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.Tensor.transpose and args[0] is self.weight and tuple(args[1:]) in _LAST_TWO:
                return TransposedWeight(args[0])
            if func is torch.matmul and len(args) == 2 and isinstance(args[1], TransposedWeight):
                # the head's input is a slice of the hidden size (LmHeadLinearAllreduce): int4's kernel wants rows
                return F.linear(args[0].contiguous(), args[1].weight)
            return func(*args, **kwargs)

    return LinearOfTranspose


def adapt(module) -> List[str]:
    """Give every AutoTP linear in `module` whose weight is a tensor subclass (torchao's) the F.linear product;
    returns the names of the layers adapted."""
    import torch

    mode = _mode_class()
    names = []
    for name, layer in module.named_modules():
        weight = getattr(layer, "weight", None)
        plain = type(weight) in (torch.Tensor, torch.nn.Parameter)
        if type(layer).__name__ in AUTOTP_LINEARS and weight is not None and not plain:
            layer.forward = _under_mode(layer, layer.forward, mode)
            names.append(name)
    return names


def _under_mode(layer, forward, mode) -> Any:
    def run(*args, **kwargs):
        with mode(layer.weight):  # the weight as it is now (read at each call)
            return forward(*args, **kwargs)

    return run
