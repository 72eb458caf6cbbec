"""dsexp's own workload: load -> init (the engine) -> generate, each a measured phase; the reference and split
workloads reuse its steps."""

from __future__ import annotations

from typing import Any, Dict, Iterator, List, Optional, Tuple

from dsexp.core.bisect import next_point
from dsexp.core.context import RankContext
from dsexp.core.protocol import logits_file
from dsexp.core.workload import CHECK_BATCH, Point, dominated, grid
from dsexp.rank.budget_cap import check_simulated, simulate_point
from dsexp.rank.faults import maybe_inject, maybe_oom, oom_in_forward
from dsexp.rank.generation import point_ids
from dsexp.rank.oom_agreement import RanksEnded, agree_after_forward, ended_record, ranks_out_before_forward
from dsexp.rank.probes.phases import PhaseRecorder


def run(ctx: RankContext, rec: PhaseRecorder) -> None:
    from dsexp.engines.rank import get_engine

    engine = get_engine(ctx.spec.engine.name)
    module, report = load_and_init(ctx, rec, engine, ctx.spec.load.name)
    generate(ctx, rec, module, engine, report)


def load_and_init(ctx: RankContext, rec: PhaseRecorder, engine, loader: str) -> Tuple[Any, Dict[str, Any]]:
    """The load and init phases: the loader builds the model, the engine (None: a plain move to the device) places
    it; returns (module, the engine's report). Raises if a tensor is still on the meta device."""
    from dsexp.quant import rank as quant
    from dsexp.rank.loading import get_loader
    from dsexp.rank.probes.weights import residency, resident_bytes, tensor_bytes, tensor_layout, weight_census

    spec, device_type = ctx.spec, "cuda" if ctx.on_gpu else "cpu"
    quantized: Dict[str, Any] = {"set": quant.before_load(ctx, engine)} if engine and spec.quant.active else {}
    with rec.phase("load"):
        maybe_inject(spec.fault, ctx.rank, "load", ctx.job_dir)
        if engine:
            engine.before_load(ctx)
        loaded = get_loader(loader).load(ctx, {**engine.load_kwargs(ctx), **quant.load_kwargs(ctx)} if engine else {})
    census = weight_census(loaded.model)
    rec.annotate_phase("load", weights_device=resident_bytes(census, device_type), weights=census, loader=loaded.info)
    at_load = quant.after_load(loaded.model, ctx) if engine else None
    if at_load:
        quantized.update(at_load)

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
    if engine and quant.quantizes_after_engine(ctx):
        quantized.update(quantize_phase(ctx, rec, module, device_type))
    if engine:
        report.update(residency(full, module, device_type, ctx.torch_dtype.itemsize))
    if quantized:
        report["quant"] = quantized
    rec.note(engine=report)  # kept if generate fails; updated after it
    if census["on_meta"]:
        raise RuntimeError(
            f"{len(census['on_meta'])} tensors are still on the meta device after init: "
            f"{', '.join(census['on_meta'][:8])}"
        )
    return module, report


def quantize_phase(ctx: RankContext, rec: PhaseRecorder, module, device_type: str) -> Dict[str, Any]:
    """The `quantize` phase (torchao's members, after the engine): its own memory and time, and the weights as
    they are then (the phase `init`'s keys, so the analysis reads the last of the two)."""
    from dsexp.quant import rank as quant
    from dsexp.rank.probes.weights import resident_bytes, tensor_bytes, weight_census

    with rec.phase("quantize"):
        done = quant.quantize(module, ctx)
    census = weight_census(module)
    rec.annotate_phase(
        "quantize",
        weights_device=resident_bytes(census, device_type),
        weights=census,
        tensors=tensor_bytes(module, device_type),
    )
    return done


def generate(ctx: RankContext, rec: PhaseRecorder, module, engine, report: Dict[str, Any]) -> None:
    """Each point of the workload (dsexp.core.workload: the grid, or a batch search inside this load,
    dsexp.core.bisect) its own phase, measured (dsexp.rank.generation). A point that runs out of memory is a result:
    the other points go on, the larger ones it makes pointless are skipped; where the ranks cannot go on together
    (dsexp.rank.oom_agreement) they end after recording it, and the job relaunches them for the points left
    (`runtime["points"]`, or the search's earlier outcomes `runtime["outcomes"]`). Rank 0 saves the first-step logits
    of the first point (of a search: the first that ran); the correctness check reads them."""
    import torch

    from dsexp.quant import rank as quant
    from dsexp.rank.generation import prompt_ids

    text = prompt_ids(ctx, module.config.vocab_size)
    extra = {**(engine.generate_kwargs(ctx) if engine else {}), **(quant.generate_kwargs(ctx) if engine else {})}
    outcomes: List[Dict[str, Any]] = []
    ran_out: List[Point] = []
    single = len(grid(ctx.spec.generate)) == 1
    load_start: Optional[Dict[str, int]] = None
    for point in points_to_run(ctx, outcomes):
        key = point.phase(single)
        larger_than = dominated(point, ran_out)
        if larger_than:
            skipped = {"phase": key, "status": "skipped", "larger_than": larger_than.to_dict()}
            outcomes.append({**point.to_dict(), **skipped})
            continue
        if last_ran(outcomes) == "ok":
            # the cache an earlier point left shapes this point's blocks: on the H200, batch 10 run on batch 9's
            # reserved 0.49 GiB more than in a fresh process, and batch 11 ran where a fresh process ran out of
            # memory (results/h200/budget/gpu40_one_load against gpu40); emptied, it starts as the load left it (a
            # point that ran out of memory on any rank was released in run_point, on every rank)
            release_memory(ctx.on_gpu)
        start = allocator_start(ctx.on_gpu)
        load_start = load_start or start
        first = wants_logits(ctx, point, outcomes)
        entry, logits, tokens = run_point(ctx, rec, module, point, key, text, extra, first=first)
        if first:  # the sequences its logits call runs, or would have run where the point ran out before it
            entry["logits_batch"] = CHECK_BATCH
        if start:
            entry["start"] = {**start, "as_load": as_load(start, load_start)}
        outcomes.append(entry)
        rec.note(points=outcomes)
        if entry.get("ended"):
            rec.note(ended=entry["ended"])
            raise RanksEnded(entry["ended"]["message"])
        if entry["status"] == "oom":
            ran_out.append(point)
        elif first:
            note_nonfinite(rec, module, logits)
            if ctx.rank == 0:
                torch.save(logits, logits_file(ctx.job_dir))
            ids = point_ids(text, point.prompt_tokens)
            rec.note(generate={"prompt_ids": ids, "tokens": tokens, "new_tokens": len(tokens)})
    if engine:
        report = engine.finish(report)
    rec.note(engine=report, points=outcomes)


def last_ran(outcomes: List[Dict[str, Any]]) -> Optional[str]:
    """The status of the last point that ran ("ok" or "oom"; None before any: skipped points do not run)."""
    return next((o["status"] for o in reversed(outcomes) if o.get("status") in ("ok", "oom")), None)


def points_to_run(ctx: RankContext, outcomes: List[Dict[str, Any]]) -> Iterator[Point]:
    """The points this launch runs, in order: the grid's (or those a relaunch was given), or, under
    generate.bisect_from, the batch search's next point after each outcome (appended to `outcomes` by the caller;
    an earlier launch's come in runtime["outcomes"])."""
    g = ctx.spec.generate
    if g.bisect_from is None:
        given = ctx.runtime.get("points")
        yield from grid(g) if given is None else [Point(p["batch"], p["prompt_tokens"]) for p in given]
        return
    earlier = ctx.runtime.get("outcomes") or []
    point = next_point(g, earlier)
    while point is not None:
        yield point
        point = next_point(g, [*earlier, *outcomes])


def wants_logits(ctx: RankContext, point: Point, outcomes: List[Dict[str, Any]]) -> bool:
    """Whether this point also gives the first-step logits: the grid's first point, or a search's first point while
    none has run yet (an earlier launch's included)."""
    g = ctx.spec.generate
    if g.bisect_from is None:
        return point == grid(g)[0]
    earlier = ctx.runtime.get("outcomes") or []
    return not any(e.get("status") == "ok" for e in [*earlier, *outcomes])


def run_point(
    ctx: RankContext, rec: PhaseRecorder, module, point: Point, key: str, text: List[int], extra, first: bool = True
):
    """One point as its own phase: (its entry for the rank record's `points`, first-step logits (the grid's first
    point only: the correctness check and the NaN scan read those), tokens). An
    out-of-memory error ends the point, not the rank: recorded with the allocator's state; then the ranks agree on
    it before any of them moves on (dsexp.rank.oom_agreement), or, where they cannot, the entry says the ranks end."""
    import torch

    key = rec.begin(key)
    measured = logits = tokens = oom = None
    phases = rec.record["phases"]  # the weights as generate finds them: quantized, where a quant member ran
    weights = (phases.get("quantize") or phases.get("init") or {}).get("weights_device")
    simulated = simulate_point(ctx, weights, point)  # a CPU run under a budget (dsexp.rank.budget_cap)
    try:
        maybe_inject(ctx.spec.fault, ctx.rank, "generate", ctx.job_dir)
        maybe_oom(ctx.spec.fault, point.batch, point.prompt_tokens)
        check_simulated(simulated)
    except torch.OutOfMemoryError as e:
        oom = out_of_memory(e)
    except BaseException as e:
        rec.end(key, error=e)
        raise
    device = ctx.device if ctx.on_gpu else "cpu"
    ran_out, go_on = ranks_out_before_forward(ctx.world_size, ctx.rank, oom is not None, device), True
    if not ran_out:
        measured, logits, tokens, oom = forward(ctx, rec, module, point, key, text, extra, first)
    if oom is not None:
        oom["allocator"] = allocator_state(ctx.on_gpu)
    rec.end(key)  # its memory snapshot (probe.memory_snapshot) still holds the allocator's cache as the point left it
    # released on every rank of a point out of memory: one whose peer ran out before the forward too
    if oom is not None or ran_out:
        release_memory(ctx.on_gpu)
    if simulated:
        rec.annotate_phase(key, budget=simulated)
        rec.note(budget={k: simulated[k] for k in ("how", "budget_bytes", "cpu_scale")})
    if oom is not None and not ran_out:  # in the forward: the ranks that ran out agree out of band
        go_on, ran_out = agree_after_forward(ctx.rank, ctx.world_size, key, ctx.spec.launcher.grace_s / 2)
    entry = {**point.to_dict(), "phase": key, "status": "oom" if ran_out else "ok"}
    if ran_out:
        entry.update(oom_ranks=ran_out, error=oom)
        rec.annotate_phase(key, point={**point.to_dict(), "out_of_memory": oom, "oom_ranks": ran_out})
    else:
        rec.annotate_phase(key, point=measured)
    if not go_on:
        entry["ended"] = ended_record(ctx.rank, key, point.to_dict(), ran_out)
    return entry, logits, tokens


def forward(
    ctx: RankContext, rec: PhaseRecorder, module, point: Point, key: str, text: List[int], extra, first: bool = True
):
    """The point measured (dsexp.rank.generation): (its record, logits, tokens, None), or (None, None, None, the
    out-of-memory error) where it ran out; any other error ends the phase and the rank."""
    import torch

    from dsexp.rank.generation import measure_point

    try:
        with oom_in_forward(ctx.spec.fault, ctx.rank, module, point):
            return (*measure_point(module, ctx, point, text, extra, rec.split_window, logits=first), None)
    except torch.OutOfMemoryError as e:
        return None, None, None, out_of_memory(e)
    except BaseException as e:
        rec.end(key, error=e)
        raise


def out_of_memory(e: BaseException) -> Dict[str, Any]:
    return {"type": type(e).__name__, "message": str(e)[:2000]}


def allocator_state(on_gpu: bool) -> Dict[str, Any]:
    """What the allocator held when memory ran out: torch.cuda.memory_stats' summary and the driver's free/total
    on a GPU; the process's RSS on the CPU."""
    import psutil

    if not on_gpu:
        return {"host_rss": psutil.Process().memory_info().rss}
    import torch

    stats = torch.cuda.memory_stats()
    free, total = torch.cuda.mem_get_info()
    keys = (
        "allocated_bytes.all.current",
        "allocated_bytes.all.peak",
        "reserved_bytes.all.current",
        "reserved_bytes.all.peak",
        "inactive_split_bytes.all.current",
        "num_alloc_retries",
        "num_ooms",
    )
    return {**{k: stats.get(k) for k in keys}, "driver_free": free, "driver_total": total}


def allocator_start(on_gpu: bool) -> Dict[str, int]:
    """The allocator's state as a point starts (on a GPU; {} on the CPU): allocated, reserved and segments."""
    if not on_gpu:
        return {}
    import torch

    stats = torch.cuda.memory_stats()
    keys = {"allocated": "allocated_bytes.all.current", "reserved": "reserved_bytes.all.current"}
    return {**{k: int(stats.get(v, 0)) for k, v in keys.items()}, "segments": int(stats.get("segment.all.current", 0))}


CACHED_SLACK = 2 * 2**20  # one small-pool segment: a handful of small blocks that outlive a point


def as_load(start: Dict[str, int], load_start: Dict[str, int]) -> bool:
    """Whether a point starts with the cached (reserved, unallocated) bytes the load's first point started with: a
    fresh process's state at that point. What outlives a point in a segment of its own (cuBLAS's workspace, made at
    the first product) adds as many bytes reserved as allocated; a block that outlives it inside a larger segment
    keeps that segment's free bytes cached (empty_cache cannot release it), and the point is not a fresh one."""

    def cached(s: Dict[str, int]) -> int:
        return s["reserved"] - s["allocated"]

    return abs(cached(start) - cached(load_start)) <= CACHED_SLACK


def release_memory(on_gpu: bool) -> None:
    """Hand an earlier point's tensors back before the next point; on a GPU, cuBLAS's workspaces and the allocator's
    cached blocks too, so that the point starts with the load's segments exactly: on an H100 batch 5 after batch 4
    started as the load left it, to the byte in allocated and reserved and in segments (results/h200/point_start)."""
    import gc

    gc.collect()
    if on_gpu:
        import torch

        clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
        if clear is not None:
            clear()
        torch.cuda.empty_cache()


def note_nonfinite(rec: PhaseRecorder, module, logits, where: Optional[str] = None) -> None:
    """Logits with NaN/inf: name what holds them (the failure path: a full scan of parameters and buffers)."""
    import torch

    if torch.isfinite(logits).all():
        return
    from dsexp.rank.loading.buffers import nonfinite

    rec.note(nonfinite=nonfinite({**dict(module.named_parameters()), **dict(module.named_buffers())})[:50])
