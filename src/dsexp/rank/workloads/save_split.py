"""load=sharded's one-off split: the engine places an eager load, then each rank saves its own slice (read by
dsexp.rank.loading.sharded in later runs)."""

from __future__ import annotations

from dsexp.core.context import RankContext
from dsexp.rank.probes.phases import PhaseRecorder
from dsexp.rank.workloads.pipeline import load_and_init


def run(ctx: RankContext, rec: PhaseRecorder) -> None:
    from dsexp.engines.rank import get_engine
    from dsexp.rank.loading.slices import save_rank_slice

    module, _ = load_and_init(ctx, rec, get_engine(ctx.spec.engine.name), "eager")
    with rec.phase("save"):
        rec.note(split=save_rank_slice(module, ctx))
