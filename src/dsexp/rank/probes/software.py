"""The software a rank actually ran on: versions of the packages it imported, and every top-level module it loaded.

Read at the end of the run, from the rank's own `sys.modules`, so a software stack that shadows the job
environment (`stack=`) is recorded as it was used, not as it was configured."""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from typing import Any, Dict, Optional

from dsexp.core.schema import DISTRIBUTIONS

PACKAGES = ("torch", "transformers", "deepspeed", "accelerate", "safetensors", "tokenizers", "numpy", "huggingface_hub")


def imported_version(module: str) -> Optional[str]:
    """The version of an imported package: its own __version__ (what was loaded), else its distribution's."""
    mod = sys.modules.get(module)
    if mod is None:
        return None
    found = getattr(mod, "__version__", None)
    if isinstance(found, str):
        return found
    try:
        return version(DISTRIBUTIONS.get(module, module))
    except PackageNotFoundError:
        return None


def software() -> Dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "versions": {p: imported_version(p) for p in PACKAGES if p in sys.modules},
        "modules": sorted({name.split(".")[0] for name in list(sys.modules) if not name.startswith("_")}),
    }
