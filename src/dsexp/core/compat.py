"""The few calls whose spelling changed between the transformers and DeepSpeed versions a stack may pin.

Ranks run on whatever their stack provides (transformers 4.42 to 5.x, DeepSpeed 0.14 to 0.19), so version
differences are decided here, by the version actually imported, never by try/except around a real call."""

from __future__ import annotations

from functools import lru_cache
from importlib.metadata import PackageNotFoundError, version
from typing import Dict, Optional, Tuple

from dsexp.core.schema import version_tuple


@lru_cache(maxsize=None)
def _version(module: str) -> Tuple[int, ...]:
    import importlib

    return version_tuple(importlib.import_module(module).__version__)


def installed(package: str) -> Optional[str]:
    """The distribution's version first on the path (a stack's overlay before the job environment); None if absent."""
    try:
        return version(package)
    except PackageNotFoundError:
        return None


def transformers_version() -> Tuple[int, ...]:
    return _version("transformers")


def dtype_kwargs(dtype) -> Dict[str, object]:
    """The dtype argument of from_pretrained/from_config: `dtype` from transformers 4.56 on, `torch_dtype` before
    (4.42 rejects `dtype=` in from_config and breaks on it in from_pretrained)."""
    return {"dtype": dtype} if transformers_version() >= (4, 56) else {"torch_dtype": dtype}


def config_fields(cls) -> Dict[str, object]:
    """{field name: field} of a DeepSpeed config class: pydantic 2 (`model_fields`, DeepSpeed >= 0.15) or the
    pydantic.v1 classes DeepSpeed 0.14 uses (`__fields__`)."""
    fields = getattr(cls, "model_fields", None)
    return dict(fields) if fields else dict(getattr(cls, "__fields__", {}))


def quiet_optional_imports() -> None:
    """What a dsexp command prints that no user asked for: transformers imports torchao where it is installed (for
    quant=), and torchao says its optional GPU kernels could not load and torch notes its enums; neither matters to
    a command that quantizes nothing, and a quantizing job's ranks log their own."""
    import logging

    logging.getLogger("torchao").setLevel(logging.ERROR)
    logging.getLogger("torch.utils._pytree").setLevel(logging.ERROR)
