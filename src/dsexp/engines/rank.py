"""The engines' rank side: the base class every member's `rank.ENGINE` extends (wrap a loaded model for inference
and report what it actually did to it), and `get_engine`, which the workloads call. Imported on ranks only."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from typing import Any, Dict, Optional, Tuple

from dsexp.core.context import RankContext
from dsexp.engines import part
from dsexp.trims.dedupe_buffers.rank import HeldBuffers, dedupe_buffers
from dsexp.trims.env.rank import env_seen
from dsexp.trims.last_logits.rank import keep_last_logits


def get_engine(name: str) -> "Engine":
    """The engine member's rank-side class, instantiated."""
    return part(name, "rank").ENGINE()


class Engine(ABC):
    name: str = ""

    def before_load(self, ctx: RankContext) -> None:
        """Set-up that must precede loading (e.g. ZeRO-3's HfDeepSpeedConfig)."""

    def load_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        """Extra from_pretrained arguments this engine needs (e.g. a TP plan)."""
        return {}

    def wrap(self, model, ctx: RankContext, checkpoint: Optional[Any] = None) -> Tuple[Any, Dict[str, Any]]:
        """Return (module to generate with, report of what was done, with the module classes it replaced).

        trim.dedupe_buffers: the duplicate buffers are held out of the model while the engine places it (one copy
        of each reaches the device) and put back by `after_finalize`."""
        before = class_census(model)
        self.held = HeldBuffers(model) if ctx.spec.trim.dedupe_buffers else None
        module, report = self.apply(model, ctx, checkpoint)
        report["modules"] = module_changes(before, class_census(module))
        return module, report

    def after_finalize(self, module, ctx: RankContext, report: Dict[str, Any]) -> None:
        """After the engine and the loader's fix-ups (buffer restore): the trims that need the final modules
        (dedupe_buffers, last_logits), and the trim.env values the rank saw, into report["trims"]."""
        t = ctx.spec.trim
        if not (t.dedupe_buffers or t.last_logits or t.env):
            return
        done = report.setdefault("trims", {})
        if t.last_logits:
            done["last_logits"] = keep_last_logits(module)
        if t.dedupe_buffers:
            held = getattr(self, "held", None)
            done["dedupe_buffers"] = dedupe_buffers(module, held, "cuda" if ctx.on_gpu else "cpu")
            restored = (report.get("finalize") or {}).get("buffers")
            if restored and held is not None:  # held buffers were not there to restore: they share a restored one
                restored["not_found"] = [n for n in restored["not_found"] if n not in held.of]
        if t.env:
            done["env"] = env_seen(t.env)

    @abstractmethod
    def apply(self, model, ctx: RankContext, checkpoint: Optional[Any] = None) -> Tuple[Any, Dict[str, Any]]:
        """Wrap the model for inference; return (module to generate with, report)."""

    def generate_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        return {}

    def finish(self, report: Dict[str, Any]) -> Dict[str, Any]:
        """Called after generate: add what can only be known then (e.g. config fields never read)."""
        return report


def class_census(module) -> Counter:
    return Counter(type(m).__name__ for m in module.modules())


def module_changes(before: Counter, after: Counter) -> Dict[str, Dict[str, int]]:
    """Which module classes the engine removed (replaced) and which it introduced."""
    return {
        "removed": {k: before[k] - after.get(k, 0) for k in before if before[k] > after.get(k, 0)},
        "added": {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0)},
    }
