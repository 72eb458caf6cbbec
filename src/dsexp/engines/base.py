"""The engines family's interface (`engine=` group): what an engine declares of itself, on the standard library,
dsexp.core and the trims' traits alone.

A member is one folder, dsexp/engines/<name>/, selected by conf/engine/<name>.yaml:
- `__init__.py`: TRAITS, an EngineTraits (or a subclass carrying the engine's own validation rules and its version
  gate); imports the standard library and dsexp.core only, so validation, the memory model and the ranks all read it;
- `rank.py`: ENGINE, the class that wraps the model on a rank (a dsexp.engines.rank.Engine); imported on ranks only;
- `placement.py`: `place`, the engine's rule in the memory model (a dsexp.predict.placements.Placer); imported by
  the family's dispatch (dsexp.engines.placement) only.
The registry (dsexp.engines) is built from the folders into FAMILY below. The injection policy the AutoTP engines
apply is resolved here, once, for the ranks and the memory model alike. The engines import the trims, never the other
way: an engine's check asks each trim switched on whether it can act under it, handing it the engine's traits.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Union

from dsexp.core.gates import VersionGate
from dsexp.core.schema import ConfigError
from dsexp.trims import TRIMS

if TYPE_CHECKING:
    from dsexp.core.schema import JobConfig


@dataclass(frozen=True)
class EngineTraits:
    name: str
    splits_weights: bool  # tensor parallelism: each rank keeps its slice of the weights and its own KV heads
    zero3: bool  # built on deepspeed.initialize with ZeRO stage 3 (needs zero.stage=3)
    even_heads: bool  # splits attention rows evenly: tp must divide the KV heads
    casts_buffers: bool  # casts the whole module, buffers included, to the run dtype
    fills_meta: bool  # can place a model built on the meta device (load=meta|sharded)
    summary: str
    inference_autotp: bool = False  # runs init_inference's AutoTP, whose call the AutoTP trims change (dsexp.trims)
    gate: Optional[VersionGate] = None  # what it needs of the ranks' software

    def check(self, spec: "JobConfig") -> None:
        """Raise ConfigError where a pipeline job cannot run under this engine: its own rules (`rules`), then each
        trim switched on that cannot act under it (an AutoTP-only trim: see dsexp.trims.base)."""
        self.rules(spec)
        for trim in TRIMS.values():
            if getattr(spec.trim, trim.key, False):
                problem = trim.engine_problem(self, spec.engine.kernel_inject, FAMILY)
                if problem:
                    raise ConfigError(problem)

    def rules(self, spec: "JobConfig") -> None:
        """The engine's own rules on a pipeline job, beyond what the traits say (raise ConfigError)."""

    def device_problem(self, spec: "JobConfig", device: str) -> Optional[str]:
        """Why the engine cannot run this job on `device` ("cpu" or "cuda"); None: it can."""
        return None

    def shared_gpu_problem(self, spec: "JobConfig") -> Optional[str]:
        """Why the engine cannot run with ranks sharing a GPU; None: it can."""
        return None


# Every engine, {name: traits}: dsexp.engines fills it from its folders when the package is imported (Python imports a
# package before any of its modules, this one included) and serves it as ENGINES. Held here so that `check` can name
# the engines that take a trim without importing the registry above it.
FAMILY: Dict[str, EngineTraits] = {}


# --- the injection policy (engine.injection_policy) ---------------------------------------------------------------

INFER = "infer"  # engine.injection_policy=infer: dsexp finds the policy (dsexp.models.policy) on the model itself


def effective_policy(
    injection_policy: Any, kernel_inject: bool, model_policy: Optional[Dict[str, List[str]]]
) -> Union[None, str, Dict[str, List[str]]]:
    """The AutoTP injection policy an engine applies. `auto`: the model preset's policy whenever kernel
    injection is off; null: none (DeepSpeed's own parser); `infer`: INFER, resolved on the model itself by
    dsexp.models.policy.infer_policy (known layouts, DeepSpeed's parser, the module structure; a model preset's
    policy is not used); else the user's {layer class: [linears]}."""
    if injection_policy == "auto":
        return None if kernel_inject else (dict(model_policy) if model_policy else None)
    if injection_policy == INFER:
        return None if kernel_inject else INFER
    return dict(injection_policy) if injection_policy else None
