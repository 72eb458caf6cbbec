"""Version gates: what an engine or a trim needs of the software the ranks run on (a stack's pins, checked before
launch). Each family member declares its own gate (dsexp.engines, dsexp.trims)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional


@dataclass(frozen=True)
class VersionGate:
    package: str  # a stack pin: stack.<package>
    oldest: str  # the oldest version that works
    why: str  # what is missing before it

    def problem(self, who: str, stack: Any) -> Optional[str]:
        """Why `who` ("engine=<name>", "trim.<key>=true") cannot run on the stack's pin of the package; None: it can
        (no pin, a path or a newer version)."""
        from packaging.version import Version

        package, pinned = self.package, getattr(stack, self.package)
        if pinned and str(pinned)[0].isdigit() and Version(str(pinned)) < Version(self.oldest):
            return f"{who} with stack.{package}={pinned}: {self.why}; pin {package} >= {self.oldest} or leave it out"
        return None
