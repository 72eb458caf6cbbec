"""`load=sharded`: each rank reads only its own slice, written once per (model, tp, dtype, ...) by the job's
split step (dsexp.job.split).

The model is built on meta; `init_inference` runs AutoTP on it as usual (DeepSpeed keeps meta
slices on meta, `TensorParallel_Layer.move`) and, finding the model on meta, `to_empty`s it on the
rank's device: exactly this rank's slices, uninitialised. We then fill them from the rank's files,
strictly (every module tensor present, same shape, nothing extra). `to_empty` unties a tied head that the
split's engine kept tied (DeepSpeed 0.14); the index names it, and the fill ties it again. The files are
already in the run dtype, so a converting checkpoint costs the conversion once, in the split, not on every run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict

from dsexp.core.context import RankContext
from dsexp.rank.loading import buffers, files
from dsexp.rank.loading.base import Loaded, Loader
from dsexp.rank.loading.buffers import build_on_meta
from dsexp.rank.loading.slices import rank_index


class ShardedLoader(Loader):
    name = "sharded"

    def load(self, ctx: RankContext, hf_kwargs: Dict[str, Any]) -> Loaded:
        model = build_on_meta(ctx)
        originals = buffers.snapshot(model)
        index = rank_index(Path(ctx.runtime["split"]["dir"]), ctx.rank)
        paths = index["files"]
        return Loaded(
            model,
            finalize=buffers.restoring(ctx, originals, lambda m: {"fill": files.fill(m, paths, index["tied"])}),
            info={"buffers": buffers.built_report(originals), "rank_files": [str(p) for p in paths]},
        )
