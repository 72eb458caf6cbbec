"""The memory model's view of one configuration of a budget search, before anything runs.

Per rank: the allocator's reserve for the weights (dsexp.predict.job.predict, the plan's and the report's function),
what the process holds outside the
allocator (a CUDA context on a GPU: CUDA_CONTEXT_BYTES; nothing on a CPU run, whose device budget is simulated) and
the bytes above the weights at each batch (dsexp.predict.capacity). The device need at a batch is the busiest rank's;
a configuration whose need at the smallest batch passes the budget, that takes more GPUs than the budget has, or whose
loading is predicted to pass the host budget is a predicted miss, named by the term that breaks the budget.
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.compose.budget.search import Miss
from dsexp.core.schema import JobConfig

GIB = 2**30


@dataclass
class Predicted:
    needs: List[int]  # device need at each batch of the range (busiest rank)
    host: Optional[int]  # host bytes loading adds over the ranks
    miss: Optional[Miss]
    terms: Dict[str, int] = field(default_factory=dict)  # the busiest rank's terms at the smallest batch
    note: Optional[str] = None  # the model could not predict this configuration (it runs anyway)
    replayed: Optional[int] = (
        None  # the largest batch the caching allocator's replay fits (fragmentation; where traced)
    )
    replay: Dict[str, Any] = field(default_factory=dict)  # where it was traced, or why it was not replayed
    fails: Optional[str] = None  # why the engine's own init refuses it (dsexp's pipeline only): never launched
    kernel_limit: Optional[Dict[str, Any]] = None  # the largest batch the quant member's kernel takes, and why


def outside_bytes(spec: JobConfig) -> int:
    if spec.device != "cuda":
        return 0
    from dsexp.predict.fit import CUDA_CONTEXT_BYTES

    return CUDA_CONTEXT_BYTES


def weights_held(pred, spec: JobConfig) -> List[int]:
    """Per rank: what the allocator reserves for the weights on a GPU; on a CPU run (no caching allocator) their
    bytes."""
    return pred.reserve if spec.device == "cuda" else pred.weights


def terms_at(pred, spec: JobConfig, batch: int) -> Dict[str, List[int]]:
    """The capacity model's terms above the weights at this batch, per rank, as its fit check counts them
    (dsexp.predict.capacity.fit_terms)."""
    from dsexp.predict import capacity as cap

    g = spec.generate
    return cap.fit_terms(
        pred.dims, pred.strategy, pred.tp, cap.Workload(batch, int(g.prompt_tokens), int(g.new_tokens))
    )


def rank_terms(pred, spec: JobConfig, batch: int) -> List[Dict[str, int]]:
    """Each rank's terms at this batch, in the order they are allocated: weights, outside, then the capacity model's."""
    above, outside = terms_at(pred, spec, batch), outside_bytes(spec)
    return [
        {"weights": weights_held(pred, spec)[r], "outside": outside, **{k: int(v[r]) for k, v in above.items()}}
        for r in range(pred.tp)
    ]


def device_needs(pred, spec: JobConfig, batch: int) -> List[int]:
    """Per rank: the capacity model's peak (weights included) plus what lives outside the allocator."""
    from dsexp.predict.capacity import peak_per_rank

    return [p + outside_bytes(spec) for p in peak_per_rank(weights_held(pred, spec), terms_at(pred, spec, batch))]


def token_limit(pred, spec: JobConfig) -> Optional[Miss]:
    """Kernel injection's workspace holds max_out_tokens tokens: prompt + new tokens past it cannot run at any batch
    (dsexp.predict.capacity.limit_cause)."""
    from dsexp.predict.capacity import Workload, limit_cause

    g = spec.generate
    if not limit_cause(pred.strategy, Workload(1, int(g.prompt_tokens), int(g.new_tokens))):
        return None
    return Miss("max_out_tokens", int(g.prompt_tokens) + int(g.new_tokens), spec.engine.max_out_tokens, where="tokens")


def predict_spec(
    spec: JobConfig, tp: Optional[int] = None, device: Optional[str] = None, model_dir: Optional[str] = None
):
    """The memory model for this job's spec alone (nothing has run): dsexp.predict.job.predict with the families'
    rules, on the spec's device or another; model_dir: a checkpoint folder already here whose file sizes to read."""
    from dsexp.engines.placement import RULES
    from dsexp.predict.job import Facts, predict

    return predict(script_config(spec), RULES, Facts(device=device or spec.device, model_dir=model_dir), tp or spec.tp)


def script_config(spec: JobConfig) -> Dict[str, Any]:
    """The spec as plain data; a user's script, not yet run, as its config says it will run
    (dsexp.engines.placement.script_as_configured)."""
    from dsexp.engines.placement import script_as_configured

    return script_as_configured(asdict(spec)) if spec.workload == "script" else asdict(spec)


def predict_config(spec: JobConfig, batches: List[int]) -> Predicted:
    from dsexp.predict.job import breaking_term, kernel_limit

    b = spec.budget
    device = int(b.gpu_gib * GIB)
    try:
        pred = predict_spec(spec)
        per_batch = [device_needs(pred, spec, x) for x in batches]
    except Exception as e:  # the model cannot say: measure it (the run will)
        return Predicted([0] * len(batches), None, None, note=f"not predicted: {type(e).__name__}: {e}")
    needs = [max(x) for x in per_batch]
    busiest = per_batch[0].index(needs[0])
    terms = rank_terms(pred, spec, batches[0])[busiest]
    host = pred.host.node if pred.host else None
    miss = None
    too_long = token_limit(pred, spec)
    if spec.tp > b.gpus:
        miss = Miss("gpus", spec.tp, b.gpus, where="gpus")
    elif too_long is not None:
        miss = too_long
    elif needs[0] > device:
        miss = Miss(breaking_term(terms, device), needs[0], device)
    elif b.host_gib is not None and host is not None and host > b.host_gib * GIB:
        miss = Miss("host (loading)", host, int(b.host_gib * GIB), where="host")
    fails = None if miss else init_fails(pred, spec)  # a miss is never launched: no init to foresee
    replay = {} if miss or fails else replayed_largest(pred, spec, batches, needs, device)
    batch = replay.pop("batch", None)
    limit = kernel_limit(pred, int(spec.generate.prompt_tokens)) if spec.workload != "script" else None
    return Predicted(needs, host, miss, terms, "; ".join(pred.notes) or None, batch, replay, fails, limit)


def init_fails(pred, spec: JobConfig) -> Optional[str]:
    """Why DeepSpeed's own init refuses this configuration, run on the meta device as each rank
    (dsexp.predict.job.fails_in_init), for dsexp's pipeline; a user's script calls the engine its own way: None."""
    from dsexp.engines.placement import RULES
    from dsexp.predict.job import fails_in_init

    return None if spec.workload == "script" else fails_in_init(pred, script_config(spec), RULES)


def replayed_largest(pred, spec: JobConfig, batches: List[int], needs: List[int], device: int) -> Dict[str, Any]:
    """Where the point can be replayed through the caching allocator (dsexp's pipeline on a GPU, its ranks traced:
    dsexp.engines.placement.rank_model), the largest batch of the range it fits under the cap each rank gets (the
    budget less what lives outside the allocator), with the allocator setting the configuration runs (trim.env), as
    `batch`, with where it was traced; else why it was not replayed (nothing on a CPU run or for a user's script). It
    starts from the allocated bytes' answer and walks down: fragmentation only lowers it
    (dsexp.predict.fragmentation). The trace is transformers' own generate: where the configuration's stack pins
    another transformers than this environment's, it runs in the stack's overlay (replayed_in_stack); where it cannot
    run there, here, with the version note and why (`not_in_stack`)."""
    from dsexp.job.overlay import other_transformers

    fitting = [b for b, need in zip(batches, needs) if need <= device]
    if spec.device != "cuda" or spec.workload == "script" or not fitting:
        return {}
    cap, largest = device - outside_bytes(spec), max(fitting)
    wanted = other_transformers(spec.stack)
    found = replayed_in_stack(spec, cap, largest, wanted) if wanted else {}
    if not found.get("in_stack"):  # here; where the stack could not trace, another version's replay beats none
        why = found.get("not_replayed")
        found = replay_here(pred, spec, cap, largest)
        if why:
            found["not_in_stack"] = why
    if "not_replayed" in found:
        return {"not_replayed": found["not_replayed"]}
    where = {k: found[k] for k in ("traced_with", "version_note", "in_stack", "not_in_stack") if k in found}
    return {"batch": found["batch"], **where}


def replay_here(pred, spec: JobConfig, cap: int, largest: int) -> Dict[str, Any]:
    """The replay of dsexp.predict.job.largest_batch_answer (the plan's largest batch, the same function) for this
    configuration under the cap its ranks set, searched from `largest`, traced in this environment; its answer for
    the configuration's allocator setting as `batch`."""
    from dsexp.engines.placement import RULES
    from dsexp.predict.job import largest_batch_answer

    g = spec.generate
    answer = largest_batch_answer(pred, script_config(spec), RULES, int(g.prompt_tokens), int(g.new_tokens), cap, 0,
                                  start=largest)  # fmt: skip
    found = answer["replayed"]
    return found if "not_replayed" in found else {**found, "batch": answer["largest_batch"]}


def replayed_in_stack(spec: JobConfig, cap: int, largest: int, wanted: str) -> Dict[str, Any]:
    """replay_here's answer traced under the transformers the configuration's stack pins (`wanted`), in a process
    with the stack's overlay first on the path, as its ranks will run (dsexp.compose.budget.in_stack), marked
    `in_stack`; or `not_replayed` saying why (a stack that cannot be prepared, a replay that failed there, an
    overlay that did not put its transformers first, transformers 4: not prepared)."""
    from dsexp.job.overlay import StackError, failed_tail, run_in_stack
    from dsexp.predict.job import traceable_under

    if not traceable_under(wanted):
        return {"not_replayed": f"the trace needs transformers 5, the stack runs {wanted}"}
    request = json.dumps({"spec": asdict(spec), "cap": cap, "largest": largest})
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "replay.json"
        try:
            proc = run_in_stack(spec.stack, spec.cache_dir, "dsexp.compose.budget.in_stack", str(out), stdin=request)
        except StackError as e:
            return {"not_replayed": f"its stack could not be prepared: {e}"}
        if proc.returncode != 0 or not out.is_file():
            return {"not_replayed": f"its replay in the stack failed: {failed_tail(proc)}"}
        found = json.loads(out.read_text())
    traced = found.get("traced_with")
    if traced and traced != f"transformers {wanted}":
        return {"not_replayed": f"its stack's overlay traced with {traced}, not {wanted}"}
    return {**found, "in_stack": True}


def need_at(spec: JobConfig, batch: int, tp: Optional[int] = None) -> Optional[int]:
    """The model's device need (busiest rank) for this configuration at another batch or tp; None where it cannot
    say."""
    from dataclasses import replace

    other = replace(spec, tp=tp or spec.tp)
    try:
        pred = predict_spec(other)
        return max(device_needs(pred, other, batch))
    except Exception:
        return None


def describe(miss: Miss) -> str:
    """One line: what breaks the budget and by how much."""
    if miss.where == "gpus":
        return f"tp={int(miss.need)} needs {int(miss.need)} GPUs; the budget has {int(miss.budget)}"
    if miss.where == "tokens":
        return (
            f"prompt + new tokens = {int(miss.need)} exceed kernel injection's max_out_tokens={int(miss.budget)} "
            "(its workspace holds that many; raise engine.max_out_tokens)"
        )
    from dsexp.analysis.measured import human

    where = "per GPU" if miss.where == "device" else "on the host"
    return (
        f"{miss.term} carries the need to {human(miss.need)} {where}, "
        f"{human(miss.over)} over the budget's {human(miss.budget)}"
    )


def as_dict(p: Predicted) -> Dict[str, Any]:
    return asdict(p)
