"""The trims family's interface (`trim=` group): what a trim declares of itself, on the standard library alone.

A member is one folder, dsexp/trims/<key>/, switched by `trim.<key>` (a field of dsexp.core.schema.TrimConfig, listed
in conf/trim/none.yaml):
- `__init__.py`: TRAITS, a TrimTraits (or a subclass with the trim's own validation), and any rule the ranks and the
  memory model share; imports the standard library and dsexp.core only (validation, reports and ranks read it);
- `rank.py`: what the trim does on a rank (called by the engines' rank code); imported on ranks only;
- `placement.py`: its rule in the memory model, where the trim moves a tensor (called by the engines' placement
  rules); imported by dsexp.analysis only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from dsexp.core.gates import VersionGate
from dsexp.core.schema import ConfigError
from dsexp.engines import ENGINES


@dataclass(frozen=True)
class TrimTraits:
    key: str  # trim.<key>
    short: Optional[str]  # its name in a configuration's label, "trim(dedupe,head)"; None: not a switch on the model
    summary: str
    autotp_only: bool = False  # changes DeepSpeed's AutoTP call: an engine with inference_autotp, without kernels
    changes_slices: bool = False  # changes which slices a rank keeps (part of load=sharded's split files' key)
    last_position_logits: bool = False  # the head computes the last position's logits only (the memory model's logits)
    gate: Optional[VersionGate] = None  # what it needs of the ranks' software

    def applies_to(self, engine: str, kernel_inject: bool) -> bool:
        """Whether the trim can act under this engine (an AutoTP-only trim: init_inference's AutoTP)."""
        takes = engine in ENGINES and ENGINES[engine].inference_autotp and not kernel_inject
        return not self.autotp_only or takes

    def check(self, spec) -> None:
        """Raise ConfigError where the trim is on and cannot apply (an AutoTP-only trim: the engine)."""
        engine = spec.engine
        if not self.autotp_only or not getattr(spec.trim, self.key):
            return
        if not ENGINES[engine.name].inference_autotp:
            takers = "|".join(n for n, t in ENGINES.items() if t.inference_autotp)
            raise ConfigError(
                f"trim.{self.key}=true changes DeepSpeed's AutoTP call and needs engine={takers}; "
                f"engine={engine.name} does not run it (trim.dedupe_buffers applies to every engine)"
            )
        if engine.kernel_inject:
            raise ConfigError(
                f"trim.{self.key}=true needs AutoTP: engine.kernel_inject=true replaces layers with DeepSpeed kernels "
                "instead; set engine.kernel_inject=false"
            )
