"""The trims family's interface (`trim=` group): what a trim declares of itself, on the standard library alone.

A member is one folder, dsexp/trims/<key>/, switched by `trim.<key>` (a field of dsexp.core.schema.TrimConfig, listed
in conf/trim/none.yaml):
- `__init__.py`: TRAITS, a TrimTraits (or a subclass with the trim's own validation), and any rule the ranks and the
  memory model share; imports the standard library and dsexp.core only (validation, reports and ranks read it);
- `rank.py`: what the trim does on a rank (called by the engines' rank code); imported on ranks only;
- `placement.py`: its rule in the memory model, where the trim moves a tensor (called by the engines' placement
  rules); imported by dsexp.analysis only.
The trims never import the engines (the engines import the trims): where a rule needs an engine's traits, the caller
hands them in (`applies_to`, `engine_problem`; dsexp.engines.base.EngineTraits.check asks the latter of every trim).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Protocol

from dsexp.core.gates import VersionGate


class EngineFacts(Protocol):
    """What a trim's rules read of an engine's traits (a dsexp.engines.base.EngineTraits, handed in by the caller)."""

    @property
    def name(self) -> str: ...

    @property
    def inference_autotp(self) -> bool: ...


@dataclass(frozen=True)
class TrimTraits:
    key: str  # trim.<key>
    short: Optional[str]  # its name in a configuration's label, "trim(dedupe,head)"; None: not a switch on the model
    summary: str
    autotp_only: bool = False  # changes DeepSpeed's AutoTP call: an engine with inference_autotp, without kernels
    changes_slices: bool = False  # changes which slices a rank keeps (part of load=sharded's split files' key)
    last_position_logits: bool = False  # the head computes the last position's logits only (the memory model's logits)
    gate: Optional[VersionGate] = None  # what it needs of the ranks' software

    def applies_to(self, engine: Optional[EngineFacts], kernel_inject: bool) -> bool:
        """Whether the trim can act under this engine (None: not an engine dsexp knows); an AutoTP-only trim needs
        init_inference's AutoTP (an engine with inference_autotp, without kernel injection)."""
        takes = engine is not None and engine.inference_autotp and not kernel_inject
        return not self.autotp_only or takes

    def engine_problem(
        self, engine: EngineFacts, kernel_inject: bool, engines: Mapping[str, EngineFacts]
    ) -> Optional[str]:
        """Why the trim, switched on, cannot act under this engine (`engines`: every engine, {name: traits}, to name
        those that could); None: it can."""
        if not self.autotp_only:
            return None
        if not engine.inference_autotp:
            takers = "|".join(n for n, t in engines.items() if t.inference_autotp)
            return (
                f"trim.{self.key}=true changes DeepSpeed's AutoTP call and needs engine={takers}; "
                f"engine={engine.name} does not run it (trim.dedupe_buffers applies to every engine)"
            )
        if kernel_inject:
            return (
                f"trim.{self.key}=true needs AutoTP: engine.kernel_inject=true replaces layers with DeepSpeed kernels "
                "instead; set engine.kernel_inject=false"
            )
        return None

    def check(self, spec) -> None:
        """The trim's own rules on a job's config (raise dsexp.core.schema.ConfigError); those against the job's engine
        are `engine_problem`'s, which the engine asks (dsexp.engines.base.EngineTraits.check)."""
