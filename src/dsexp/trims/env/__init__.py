"""trim.env: environment variables for the ranks, the settings of the memory outside PyTorch's allocator (NCCL, CUDA
module loading, cuBLAS workspaces) and of the allocator itself. Validation allows the names below and turns values
into strings; dsexp.job.launch sets them last in the ranks' environment; rank.py records what a rank saw. It places no
tensor: the memory model has no rule for it.
"""

from __future__ import annotations

from typing import Any, Optional

from dsexp.core.schema import ConfigError
from dsexp.trims.base import TrimTraits

ENV_PREFIXES = ("NCCL_", "TORCH_NCCL_")
ENV_NAMES = (
    "CUDA_MODULE_LOADING",
    "PYTORCH_CUDA_ALLOC_CONF",
    "PYTORCH_ALLOC_CONF",
    "CUBLAS_WORKSPACE_CONFIG",
    "CUBLASLT_WORKSPACE_SIZE",
)
ENV_FIXED = {"NCCL_NVLS_ENABLE": "dsexp sets it to 0 for every job (NVLink multicast stays off)"}


def env_problem(key: str, value: Any) -> Optional[str]:
    """Why `trim.env.<key>` cannot be set (None: it can)."""
    if key in ENV_FIXED:
        return f"trim.env.{key}: {ENV_FIXED[key]}; it cannot be changed here"
    if not (key.startswith(ENV_PREFIXES) or key in ENV_NAMES):
        return (
            f"trim.env.{key} is not a setting dsexp passes to the ranks; allowed: names starting with "
            f"{', '.join(ENV_PREFIXES)} or one of {', '.join(ENV_NAMES)}"
        )
    if not isinstance(value, (str, int, float, bool)) or value == "":
        return f"trim.env.{key}={value!r}: give a non-empty string or number"
    return None


def env_value(value: Any) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


class EnvTraits(TrimTraits):
    def check(self, spec) -> None:
        """Only the settings dsexp knows; the values become strings (spec.trim.env is rewritten)."""
        env = {}
        for key, value in dict(spec.trim.env or {}).items():
            problem = env_problem(str(key), value)
            if problem:
                raise ConfigError(problem)
            env[str(key)] = env_value(value)
        spec.trim.env = env


TRAITS = EnvTraits("env", short=None, summary="environment of the ranks (NCCL, CUDA module loading, allocator, cuBLAS)")
