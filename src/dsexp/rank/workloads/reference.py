"""The tp=1 reference: dsexp's eager load, a plain move to the device, generate; its first-step logits are what
every measured run of the same model is checked against (dsexp.job.correctness)."""

from __future__ import annotations

from dsexp.core.context import RankContext
from dsexp.rank.probes.phases import PhaseRecorder
from dsexp.rank.workloads.pipeline import generate, load_and_init


def run(ctx: RankContext, rec: PhaseRecorder) -> None:
    module, report = load_and_init(ctx, rec, None, "eager")
    generate(ctx, rec, module, None, report)
