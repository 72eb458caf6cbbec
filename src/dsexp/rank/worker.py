"""One rank's start-up: output to its log, its config, the probes, the process group; then its workload.

Spawned by the job's launcher (torchrun or `deepspeed --no_local_rank`), never by Hydra: it reads the
job's resolved config from `<job_dir>/job.json` (dsexp.core.protocol), runs the job's workload
(dsexp.rank.workloads: dsexp's pipeline, the tp=1 reference, the split), writes `<job_dir>/ranks/rank{N}.json`
after every phase and its output to `rank{N}.log`, and never talks to MLflow.
"""

from __future__ import annotations

import time

T_PROCESS = time.perf_counter()  # before the heavy imports: the start phase includes them

import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from dsexp.core.context import RankContext  # noqa: E402
from dsexp.core.protocol import OOM_ENDED_EXIT, rank_log, read_job_file  # noqa: E402
from dsexp.rank.faults import maybe_inject  # noqa: E402
from dsexp.rank.isolation import hide_job_side_packages  # noqa: E402
from dsexp.rank.oom_agreement import RanksEnded  # noqa: E402
from dsexp.rank.output import redirect_output  # noqa: E402
from dsexp.rank.probes.phases import PhaseRecorder  # noqa: E402
from dsexp.rank.probes.snapshots import snapshot_options  # noqa: E402
from dsexp.rank.probes.software import software  # noqa: E402
from dsexp.rank.shared_gpu import setup_rank  # noqa: E402
from dsexp.rank.shm_fallback import note_fallback  # noqa: E402
from dsexp.rank.workloads import get_workload  # noqa: E402


class StackImportError(ImportError):
    """The rank's software (torch, DeepSpeed, transformers, as its stack provides them) failed to import."""


def import_stack(ctx: RankContext) -> None:
    """Import what the rank runs on, first: an import that fails is its software stack's fault. transformers
    imports most of its dependencies lazily, so its model code and every package the stack pins are imported too."""
    import importlib

    stack = ctx.runtime.get("stack") or {}
    try:
        for module in ("torch", "deepspeed", "transformers", "transformers.modeling_utils", *stack.get("modules", ())):
            importlib.import_module(module)
    except Exception as e:
        raise StackImportError(f"stack {stack.get('label', 'current')}: {type(e).__name__}: {e}") from e


def _start_distributed(ctx: RankContext, rec: PhaseRecorder) -> dict:
    """Import torch and DeepSpeed, take the device, join the process group; return how long each part took and,
    on a GPU, the memory outside PyTorch's allocator after the CUDA context and after the first collective."""
    import_stack(ctx)
    import deepspeed
    import torch

    from dsexp.rank.probes.gpu import outside_reading

    t1 = time.perf_counter()
    outside = {}
    shared = ctx.runtime.get("shared_gpu")
    if shared:
        from dsexp.rank.shared_gpu import force_gloo

        force_gloo()  # several ranks on one GPU: NCCL refuses them, gloo carries CUDA tensors
    if ctx.runtime.get("device") == "cuda":
        torch.cuda.set_device(ctx.local_rank)
        ctx.device = f"cuda:{ctx.local_rank}"
        rec.attach_cuda(ctx.local_rank)
        outside["context"] = outside_reading(ctx.local_rank, rec.nvml)
    t2 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="nccl" if ctx.on_gpu and not shared else "gloo", verbose=False)
    if ctx.world_size > 1:
        rec.align = torch.distributed.barrier  # every later phase starts on all ranks together
    first = ctx.spec.probe.first_collective
    if ctx.on_gpu and (ctx.world_size > 1 if first is None else first):
        torch.distributed.all_reduce(torch.ones(1, device=ctx.device))  # creates and connects the communicator
        outside["communicator"] = outside_reading(ctx.local_rank, rec.nvml)
    out = {"imports_s": t1 - T_PROCESS, "device_s": t2 - t1, "rendezvous_s": time.perf_counter() - t2}
    if ctx.on_gpu:
        from dsexp.rank.budget_cap import enforce

        cap = enforce(ctx, torch.cuda.current_device(), outside)
        if cap:
            rec.note(budget=cap)  # before any weight is loaded: the whole run is held to the budget
    return {**out, "outside": outside} if outside else out


def main(argv=None) -> int:
    hide_job_side_packages()  # before torch, DeepSpeed and transformers are imported
    argv = sys.argv[1:] if argv is None else argv
    job_dir = Path(argv[0])
    shared = setup_rank()  # ranks sharing a GPU: this one sees only its GPU, as cuda:0 (before CUDA is used)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    redirect_output(rank_log(job_dir, rank))
    spec, runtime = read_job_file(job_dir)
    rec = PhaseRecorder(
        job_dir,
        rank,
        world,
        local_rank,
        T_PROCESS,
        spec.probe.sample_ms,
        spec.probe.see_memory_usage,
        spec.probe.nvidia_smi,
        snapshot_options(spec.probe),
    )
    ctx = RankContext(spec, rank, local_rank, world, job_dir, Path(runtime["model_dir"]), runtime)
    workload = get_workload(runtime.get("workload", "pipeline"))
    if shared:
        rec.note(shared_gpu=shared)
    note_fallback(rec)  # before deepspeed.init_distributed: a CPU without avx512bw
    try:
        with rec.phase("start", t0=T_PROCESS):
            maybe_inject(spec.fault, rank, "start", job_dir)
            startup = _start_distributed(ctx, rec)
        rec.annotate_phase("start", **startup)
        workload.run(ctx, rec)
    except RanksEnded:  # out of memory where the peers cannot follow: recorded (`ended`); exit so the launcher
        rec.finish(software=software())  # stops the others and the job relaunches them for the points left
        return OOM_ENDED_EXIT
    except BaseException as e:  # recorded by the phase; the job classifies it
        if rec.record["error"] is None:
            rec.note(
                error={"phase": "after", "type": type(e).__name__, "message": str(e)[:2000], "time": time.time()},
                status="failed",
            )
        import traceback

        traceback.print_exc()
        rec.finish(software=software())
        return 1
    rec.finish(software=software())
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    # Everything is written (rank file, logits, log): skip the interpreter's finalisation, which takes about
    # a second with torch and DeepSpeed loaded and would add that much to every job (`make bench`).
    os._exit(code)
