"""dsexp's own workload: load -> init (the engine) -> generate, each a measured phase; the reference and split
workloads reuse its steps."""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from dsexp.core.context import RankContext
from dsexp.core.protocol import logits_file
from dsexp.rank.faults import maybe_inject
from dsexp.rank.probes.phases import PhaseRecorder


def run(ctx: RankContext, rec: PhaseRecorder) -> None:
    from dsexp.engines.rank import get_engine

    engine = get_engine(ctx.spec.engine.name)
    module, report = load_and_init(ctx, rec, engine, ctx.spec.load.name)
    generate(ctx, rec, module, engine, report)


def load_and_init(ctx: RankContext, rec: PhaseRecorder, engine, loader: str) -> Tuple[Any, Dict[str, Any]]:
    """The load and init phases: the loader builds the model, the engine (None: a plain move to the device) places
    it; returns (module, the engine's report). Raises if a tensor is still on the meta device."""
    from dsexp.rank.loading import get_loader
    from dsexp.rank.probes.weights import residency, resident_bytes, tensor_bytes, tensor_layout, weight_census

    spec, device_type = ctx.spec, "cuda" if ctx.on_gpu else "cpu"
    with rec.phase("load"):
        maybe_inject(spec.fault, ctx.rank, "load", ctx.job_dir)
        if engine:
            engine.before_load(ctx)
        loaded = get_loader(loader).load(ctx, engine.load_kwargs(ctx) if engine else {})
    census = weight_census(loaded.model)
    rec.annotate_phase("load", weights_device=resident_bytes(census, device_type), weights=census, loader=loaded.info)

    with rec.phase("init"):
        maybe_inject(spec.fault, ctx.rank, "init", ctx.job_dir)
        if engine:
            full = tensor_layout(loaded.model)
            module, report = engine.wrap(loaded.model, ctx, checkpoint=loaded.checkpoint)
        else:
            module, report = loaded.model.to(ctx.device), {"reference": True}
        if loaded.finalize:
            report["finalize"] = loaded.finalize(module)
        if engine:
            engine.after_finalize(module, ctx, report)
    del loaded
    census = weight_census(module)
    tensors = tensor_bytes(module, device_type)
    rec.annotate_phase("init", weights_device=resident_bytes(census, device_type), weights=census, tensors=tensors)
    if engine:
        report.update(residency(full, module, device_type, ctx.torch_dtype.itemsize))
    rec.note(engine=report)  # kept if generate fails; updated after it
    if census["on_meta"]:
        raise RuntimeError(
            f"{len(census['on_meta'])} tensors are still on the meta device after init: "
            f"{', '.join(census['on_meta'][:8])}"
        )
    return module, report


def generate(ctx: RankContext, rec: PhaseRecorder, module, engine, report: Dict[str, Any]) -> None:
    """The generate phase; rank 0 saves the first-step logits (the correctness check reads them)."""
    import torch

    from dsexp.rank.generation import run_generate

    with rec.phase("generate"):
        maybe_inject(ctx.spec.fault, ctx.rank, "generate", ctx.job_dir)
        out = run_generate(module, ctx, engine.generate_kwargs(ctx) if engine else {})
    if engine:
        report = engine.finish(report)
    note_nonfinite(rec, module, out["first_logits"])
    if ctx.rank == 0:
        torch.save(out["first_logits"], logits_file(ctx.job_dir))
    rec.note(
        engine=report,
        generate={"prompt_ids": out["prompt_ids"], "tokens": out["tokens"], "new_tokens": len(out["tokens"])},
    )


def note_nonfinite(rec: PhaseRecorder, module, logits, where: Optional[str] = None) -> None:
    """Logits with NaN/inf: name what holds them (the failure path: a full scan of parameters and buffers)."""
    import torch

    if torch.isfinite(logits).all():
        return
    from dsexp.rank.loading.buffers import nonfinite

    rec.note(nonfinite=nonfinite({**dict(module.named_parameters()), **dict(module.named_buffers())})[:50])
