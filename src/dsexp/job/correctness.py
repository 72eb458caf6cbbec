"""Correctness of every run: its first-step logits against a tp=1 eager reference of the same model and dtype.

The reference is computed once per (checkpoint, dtype, prompt: the workload grid's first point) by a one-rank run
of the worker in `reference` role (`dsexp.job.roles`) and cached on disk; each job compares rank 0's logits with
it. Greedy-token agreement is recorded but not gated on: random weights make near-ties that harmless rounding flips.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.core.fs import file_lock
from dsexp.core.protocol import logits_file
from dsexp.core.schema import JobConfig, QuantConfig, TrimConfig
from dsexp.core.workload import grid
from dsexp.job.roles import role_spec, run_role

# Relative L2 error of the first-step logits a correct run may show. Measured on CPU (gloo), tp=2 vs the tp=1
# reference, identical for load=eager/meta/sharded: fp32 3.9e-7 (tiny); bf16 0.0082 (tiny, 2 layers) and
# 0.0134 (small, 8 layers). That bf16 error is AutoTP's: row-parallel partial sums are rounded to bf16 before
# the all-reduce. It is as large as bf16's own error against fp32 at tp=1 (0.0063 tiny, 0.0124 small) and grows
# with depth (~sqrt(layers): ~0.03 expected at 48 layers), so 1e-2 would fail correct runs. Loading faults are
# far above: uninitialised RoPE buffers (sharded, restore_buffers=false) gave 0.37. fp16 has 3 more mantissa
# bits than bf16 (errors ~8x smaller).
TOLERANCE = {"fp32": 1e-4, "bf16": 5e-2, "fp16": 1e-2}


def reference_path(
    cache_dir: str, model_dir: Path, dtype: str, prompt: str, new_tokens: int, device: str, stack_key: str = ""
) -> Path:
    """Where the reference of this model, dtype, prompt, device and software stack is cached (`stack_key` also
    marks a reference whose buffers were left as loaded: load.restore_buffers=false)."""
    key = f"{Path(model_dir).resolve()}|{dtype}|{prompt}|{new_tokens}|{device}" + (f"|{stack_key}" if stack_key else "")
    tag = hashlib.sha1(key.encode()).hexdigest()[:12]
    return Path(cache_dir).expanduser() / "refs" / f"{Path(model_dir).name}-{dtype}-{tag}.pt"


def compare(logits, ref: Dict[str, Any], tokens: List[int], dtype: str, tol: Optional[float]) -> Dict[str, Any]:
    import torch

    ref_logits = ref["first_logits"].float()
    logits = logits.float()
    if logits.shape != ref_logits.shape:
        return {
            "logits_rel_err": None,
            "passed": False,
            "message": f"logits shape {tuple(logits.shape)} != reference {tuple(ref_logits.shape)}",
        }
    bad = nonfinite_count(logits)
    if bad:  # never an infinite "relative error": NaN/inf logits are named as such
        return {
            "logits_rel_err": None,
            "passed": False,
            "nonfinite": bad,
            "message": f"the first-step logits are not finite ({describe_nonfinite(logits)})",
        }
    rel = (torch.linalg.vector_norm(logits - ref_logits) / torch.linalg.vector_norm(ref_logits)).item()
    ref_tokens = ref.get("tokens") or []
    n = min(len(tokens), len(ref_tokens))
    agree = sum(a == b for a, b in zip(tokens[:n], ref_tokens[:n])) / n if n else None
    first_diff = next((i for i in range(n) if tokens[i] != ref_tokens[i]), None)
    tol = TOLERANCE[dtype] if tol is None else tol
    return {
        "logits_rel_err": rel,
        "tolerance": tol,
        "passed": rel <= tol,
        "token_agreement": agree,
        "first_token_mismatch": first_diff,
        "ref_tokens": ref_tokens,
    }


def nonfinite_count(t) -> int:
    import torch

    return int((~torch.isfinite(t)).sum())


def describe_nonfinite(t) -> str:
    import torch

    return f"{int(torch.isnan(t).sum())} NaN, {int(torch.isinf(t).sum())} inf of {t.numel()} values"


class ReferenceInvalid(RuntimeError):
    """The tp=1 reference cannot stand for the model: its logits are not finite, or its buffers were left as
    loaded and differ from what the model's constructor computes (cause reference_invalid). `software`: what the
    reference's rank imported (the job's own ranks never ran)."""

    def __init__(self, message: str, software: Optional[Dict[str, Any]] = None):
        super().__init__(message)
        self.software = software


def left_wrong(buffers: Dict[str, Any]) -> Dict[str, str]:
    """{name: how} for the buffers a load left differing from the constructor's and nobody put back (a dtype cast
    is a numerics choice, not a wrong value)."""
    return {n: s for n, s in (buffers.get("left_as_loaded") or {}).items() if s != "cast"}


def _names(states: Dict[str, str], limit: int = 8) -> str:
    shown = ", ".join(f"{n} ({s})" for n, s in sorted(states.items())[:limit])
    return shown + (f" and {len(states) - limit} more" if len(states) > limit else "")


def reference_problem(logits, rec: Dict[str, Any], stack: str) -> Optional[str]:
    """Why a reference cannot be used, or None: its logits are not finite (and what was not finite after its
    load), or its buffers are not the model's (left as loaded: finite logits from wrong tables are still wrong)."""
    load = ((rec.get("phases") or {}).get("load") or {}).get("loader") or {}
    bufs = load.get("buffers") or {}
    wrong = left_wrong(bufs)
    if not nonfinite_count(logits):
        if not wrong:
            return None
        return (
            f"the tp=1 reference's buffers differ from what the model's constructor computes, left as loaded "
            f"(load.restore_buffers=false) on stack {stack}: {_names(wrong)}; its logits are finite but not the "
            f"model's (load.restore_buffers=true recomputes them)"
        )
    nonfinite = bufs.get("nonfinite_as_loaded") or []
    after = (
        f"not finite after load: buffers {', '.join(nonfinite[:8])}"
        if nonfinite
        else "every buffer was finite after load"
    )
    if bufs.get("recomputed"):
        after += f" (recomputed: {', '.join(sorted(bufs['recomputed'])[:8])})"
    tensors = rec.get("nonfinite") or []
    held = f"; not finite at generate: {', '.join(tensors[:8])}" if tensors else ""
    return (
        f"the tp=1 reference's first-step logits are not finite ({describe_nonfinite(logits)}) "
        f"on stack {stack}: {after}{held}"
    )


def ensure_reference(spec: JobConfig, runtime: Dict[str, Any], job_dir: Path) -> Path:
    """The cached tp=1 eager reference for this model and dtype, computed now if missing."""
    # the point whose logits a job saves: the grid's first. Every sequence of a batch is the same prompt and only the
    # first sequence's logits are compared, so the reference runs at batch 1 whatever the batch: one reference serves
    # every batch of a budget search (34 s a job at 20B shapes on the H200 when it was keyed by batch)
    first = grid(spec.generate)[0]
    prompt = spec.generate.prompt if first.prompt_tokens is None else f"{spec.generate.prompt}|{first.prompt_tokens}"
    path = reference_path(
        spec.cache_dir,
        Path(runtime["model_dir"]),
        spec.dtype,
        prompt,
        spec.generate.new_tokens,
        runtime["device"],
        _stack_key(runtime) + ("" if spec.load.restore_buffers else "|buffers-as-loaded"),
    )
    with file_lock(Path(str(path) + ".lock")):  # jobs running at once (submitit, a cluster) compute it once
        if path.is_file():
            runtime["reference_cache_hit"] = True
            return path
        import torch

        t0 = time.perf_counter()
        ref_dir = job_dir / "reference"
        (rec,) = run_role(
            # the reference is shared by every trim (and cached without them): no trim, no trim.env
            role_spec(
                spec,
                tp=1,
                launcher__nodes=1,
                launcher__hostfile=None,
                trim=TrimConfig(),
                quant=QuantConfig(),  # the quality a quantized run costs is measured against the unquantized model
                generate__batch_size=1,
                generate__prompt_tokens=first.prompt_tokens,
                generate__repeats=1,
                generate__warmup=0,
            ),
            runtime,
            ref_dir,
            "reference",
            "the tp=1 reference run",
            missing=lambda r: None if logits_file(ref_dir).is_file() else "no logits were saved",
        )
        logits = torch.load(logits_file(ref_dir))
        problem = reference_problem(logits, rec, (runtime.get("stack") or {}).get("label", "current"))
        if problem:
            raise ReferenceInvalid(problem, rec.get("software"))
        tmp = path.with_suffix(".tmp")
        torch.save({"first_logits": logits, "tokens": rec["generate"]["tokens"]}, tmp)
        tmp.replace(path)
        runtime.update(reference_cache_hit=False, reference_s=time.perf_counter() - t0)
        return path


def _stack_key(runtime: Dict[str, Any]) -> str:
    """The stack's key for a stack with pins; "" for the job's own environment (keeps its cached references)."""
    stack = runtime.get("stack") or {}
    return stack["key"] if stack.get("pins") else ""


def check_output(spec: JobConfig, job_dir: Path, ranks: List[Optional[dict]], ref: Optional[Path]) -> Optional[dict]:
    """rank 0's first-step logits against the reference (None when there is nothing to compare)."""
    logits = logits_file(job_dir)
    if ref is None or not logits.is_file() or not ranks or not ranks[0]:
        return None
    import torch

    from dsexp.quant import label, tolerance

    tol, why = (spec.check.rel_err_tol, "check.rel_err_tol") if spec.check.rel_err_tol is not None else (None, None)
    if tol is None and spec.quant.active:
        tol, why = tolerance(spec.quant, TOLERANCE[spec.dtype])
    out = compare(torch.load(logits), torch.load(ref), ranks[0]["generate"]["tokens"], spec.dtype, tol)
    if spec.quant.active:  # the quality cost, beside the run: against the tp=1 run without quantization
        out.update(quant=label(spec.quant), tolerance_source=why, against="tp=1, unquantized, same dtype")
    return out
