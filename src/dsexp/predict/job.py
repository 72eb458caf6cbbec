"""A job's memory, predicted from its config alone: `predict(config, rules)`, the one entry the plan
(`python -m dsexp.plan`), the budget search and the report call.

The config is the job's spec as plain data (`dataclasses.asdict(JobConfig)`). What a run adds once it ran (the
checkpoint's folder, the versions and device the ranks had, the policy the engine reported, the measured memory
outside the allocator) comes as `Facts`; without them the config's word is taken, and the versions of a stack without
pins are the ones installed here. The families' rules (which engine places what, which trims are on) come as `rules`:
the memory model sits under the families and imports none of them (dsexp.engines.placement is the rules' module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Protocol

from dsexp.core.compat import installed
from dsexp.core.workload import CHECK_BATCH
from dsexp.predict import architecture as arch
from dsexp.predict import capacity as cap
from dsexp.predict.fit import CUDA_CONTEXT_BYTES
from dsexp.predict.kv import kv_bytes, kv_heads
from dsexp.predict.placements import Strategy
from dsexp.predict.weights_per_rank import Prediction, checkpoint_sizes, host, per_rank, reserve

GIB = 2**30
# Outside the caching allocator, per rank on a GPU, beside the CUDA context (predict.fit): with NCCL between GPUs,
# the world communicator, its connection buffers made at the first generate, and DeepSpeed's own tensor-parallel group
# (a second communicator; trim.world_group removes it), measured on 2x H200 (results/h200/shared/target.md). Ranks
# sharing one GPU talk over gloo: no NCCL memory.
NCCL_WORLD_BYTES = int(0.447 * GIB)
NCCL_BUFFERS_BYTES = int(0.281 * GIB)
NCCL_TP_GROUP_BYTES = int(0.660 * GIB)


class Rules(Protocol):
    """What the families know (dsexp.engines.placement): the strategy a config runs, and where its tensors lie."""

    def strategy_of(self, config: Mapping[str, Any], facts: "Facts") -> Strategy: ...

    def place(self, model, strategy: Strategy, tp: int, shared=None, with_policy: bool = False): ...

    def allocation_order(self, engine: str): ...

    def shared_buffers(self, source: Dict[str, Any], strategy: Strategy): ...

    def second_communicator(self, strategy: Strategy) -> bool: ...

    def rank_model(self, model, strategy: Strategy, placements, rank: int, tp: int): ...

    def init_fails(self, model, strategy: Strategy, tp: int) -> Optional[str]: ...

    def quantized_order(self, ranked) -> List[int]: ...


NOT_REPORTED = object()  # the engine said nothing of the policy it used
# A folder holding only config.json: its checkpoint as transformers' save_pretrained shards it (max_shard_size 5 GB)
SAVED_SHARD_MB = 5e9 / 2**20


@dataclass
class Facts:
    """What a run adds to its config (None: the run did not say; take the config's word)."""

    model_dir: Optional[str] = None
    device: Optional[str] = None
    conversion: Any = NOT_REPORTED  # the load's dtype conversion the ranks reported ("bf16->fp32" or None)
    versions: Dict[str, str] = field(default_factory=dict)  # package -> the version the ranks ran
    policy_used: Any = NOT_REPORTED  # the injection policy the engine reported (None: none)
    prompt_len: Optional[int] = None  # the prompt's tokens as the ranks tokenized it
    overhead: Optional[int] = None  # device memory outside the allocator, measured


def version(config: Mapping[str, Any], facts: Facts, package: str) -> Optional[str]:
    """The version of `package` the ranks ran: the run's word, else the stack's pin, else (a stack without pins runs
    in this environment) the one installed here."""
    pinned = (config.get("stack") or {}).get(package)
    return facts.versions.get(package) or pinned or installed(package)


def device_of(config: Mapping[str, Any], facts: Facts) -> str:
    return facts.device or config.get("device") or "cpu"


def predict(config: Mapping[str, Any], rules: Rules, facts: Optional[Facts] = None, tp: Optional[int] = None):
    """The memory model for this config, at its own tp or another one: per rank, the weights (by tensor), the
    allocator's reserve for them, the KV cache for prompt + new tokens, the host memory of its loading strategy."""
    facts = facts or Facts()
    strategy = rules.strategy_of(config, facts)
    tp = int(tp or config.get("tp") or 1)
    source = arch.model_source(dict(config), {"model_dir": facts.model_dir} if facts.model_dir else None)
    model = arch.meta_model(source, strategy.dtype)
    placements, modules, notes, error, policy = rules.place(
        model, strategy, tp, rules.shared_buffers(source, strategy), with_policy=True
    )
    weights = per_rank(placements, tp)
    d = arch.dims(model)
    tokens = _tokens(config, strategy, facts)
    kv = [kv_bytes(d, kv_heads(d.kv_heads, tp, r, strategy.splits_weights), tokens, strategy.dtype) for r in range(tp)]
    shard_mb = (config.get("model") or {}).get("shard_mb") or (SAVED_SHARD_MB if "folder" in source else None)
    files = checkpoint_sizes(facts.model_dir or source.get("folder"), shard_mb, strategy, placements)
    return Prediction(
        tp=tp,
        strategy=strategy,
        placements=placements,
        weights=weights,
        reserve=reserve(placements, weights, strategy, rules.allocation_order(strategy.engine)),
        kv_cache=kv,
        tokens=tokens,
        dims=d,
        overhead=facts.overhead,
        notes=notes,
        error=error,
        policy=policy,
        modules=modules,
        host=host(files, strategy, tp, weights, placements),
    )


def _tokens(config: Mapping[str, Any], s: Strategy, facts: Facts) -> int:
    """Prompt + generated tokens (kernel injection sizes its KV workspace for max_out_tokens instead)."""
    gen = config.get("generate") or {}
    if s.kernel_inject and s.max_out_tokens:
        return s.max_out_tokens
    n_prompt = facts.prompt_len if facts.prompt_len is not None else len(str(gen.get("prompt", "")).encode())
    return n_prompt + int(gen.get("new_tokens") or 0)


def outside(config: Mapping[str, Any], strategy: Strategy, tp: int, rules: Rules) -> Dict[str, int]:
    """{term: bytes} each rank's process holds on its GPU outside the caching allocator (nothing on a CPU run)."""
    if not str(strategy.device).startswith("cuda"):
        return {}
    terms = {"cuda_context": CUDA_CONTEXT_BYTES}
    shared = int((config.get("launcher") or {}).get("gpus") or 0) == 1 and tp > 1  # ranks on one GPU: gloo
    if tp > 1 and not shared:
        terms["communicator"] = NCCL_WORLD_BYTES + NCCL_BUFFERS_BYTES
        if rules.second_communicator(strategy):
            terms["communicator"] += NCCL_TP_GROUP_BYTES
    return terms


@dataclass
class PointPrediction:
    """One workload point on every rank: the terms above the weights, the peak, the term that dominates it."""

    workload: cap.Workload
    terms: Dict[str, List[int]]  # above the weights, per rank (dsexp.predict.capacity.above_weights)
    peak: List[int]  # weights' reserve + terms + outside the allocator, per rank
    dominant: List[str]  # per rank: the largest term above the weights
    limit: Optional[str] = None  # why it cannot run whatever the memory (kernel injection's max_out_tokens)

    def above_weights(self, rank: int) -> int:
        return sum(t[rank] for t in self.terms.values())


def at(pred: Prediction, w: cap.Workload, outside_bytes: int = 0) -> PointPrediction:
    """The prediction at one workload point (the report's capacity terms, the same function)."""
    terms = cap.above_weights(pred.dims, pred.strategy, pred.tp, w)
    peaks = [p + outside_bytes for p in cap.peak_per_rank(held(pred), terms)]
    dominant = [max(terms, key=lambda k: terms[k][r]) if terms else "-" for r in range(pred.tp)]
    return PointPrediction(w, terms, peaks, dominant, cap.limit_cause(pred.strategy, w))


def held(pred: Prediction) -> List[int]:
    """Per rank: what the device holds for the weights: the allocator's reserve on a GPU, their bytes on a CPU run."""
    return pred.reserve if str(pred.strategy.device).startswith("cuda") else pred.weights


@dataclass
class Capacity:
    """The largest batch at one prompt length on a GPU of `device_bytes`, and what breaks the next batch."""

    prompt_tokens: int
    new_tokens: int
    largest_batch: int
    breaks: str  # the term that carries the next batch's busiest rank past the device


def largest_batch(
    pred: Prediction, prompt: int, new: int, device_bytes: int, outside_bytes: int, max_batch: int = 4096
) -> Capacity:
    best = cap.largest_batch(
        pred.dims, pred.strategy, pred.tp, held(pred), prompt, new, device_bytes, outside_bytes, max_batch
    )
    limit = cap.limit_cause(pred.strategy, cap.Workload(1, prompt, new))
    if limit:
        return Capacity(prompt, new, 0, "max_out_tokens")
    if best >= max_batch:
        return Capacity(prompt, new, best, "-")
    nxt = cap.fit_terms(pred.dims, pred.strategy, pred.tp, cap.Workload(best + 1, prompt, new))
    need = [w + outside_bytes + sum(t[r] for t in nxt.values()) for r, w in enumerate(held(pred))]
    r = need.index(max(need))
    ordered = {"weights": held(pred)[r], "outside": outside_bytes, **{k: v[r] for k, v in nxt.items()}}
    return Capacity(prompt, new, best, breaking_term(ordered, device_bytes))


def breaking_term(terms: Dict[str, int], budget: int) -> str:
    """The term whose bytes, added in order, carry the total past the budget (the largest term above the weights
    where their running sum never passes it: the terms are not all held at once)."""
    total = 0
    for name, value in terms.items():
        total += value
        if total > budget:
            return name
    above = {k: v for k, v in terms.items() if k not in ("weights", "outside")}
    return max(above, key=above.get) if above else "weights"


def workloads_of(config: Mapping[str, Any], facts: Optional[Facts] = None) -> List[cap.Workload]:
    """The config's workload points (generate.batch_size x prompt_tokens, new_tokens); a prompt text counts one token
    per byte (dsexp's checkpoints carry a byte-level tokenizer) unless the run said its length."""
    from dsexp.core.workload import grid

    gen = config.get("generate") or {}
    text = (facts.prompt_len if facts and facts.prompt_len else None) or len(str(gen.get("prompt", "")).encode())
    new = int(gen.get("new_tokens") or 1)
    return [cap.Workload(p.batch, p.prompt_tokens or text, new) for p in grid(gen)]


def by_family(pred: Prediction) -> Dict[str, Dict[str, List[int]]]:
    """{tensor family (its name with layer numbers as *): {"sharded"|"replicated"|"offloaded": bytes per rank}}."""
    import re

    out: Dict[str, Dict[str, List[int]]] = {}
    for p in pred.placements:
        kind = p.how if p.how in ("replicated", "offloaded") else "sharded"
        per = out.setdefault(re.sub(r"\.\d+\.", ".*.", p.name), {}).setdefault(kind, [0] * pred.tp)
        for r in range(pred.tp):
            per[r] += p.local[r]
    return out


def plan_entry(
    pred: Prediction,
    config: Mapping[str, Any],
    rules: Rules,
    workloads: List[cap.Workload],
    gpu_bytes: Optional[int] = None,
    replay: bool = True,
) -> Dict[str, Any]:
    """What `python -m dsexp.plan` says of one configuration, as plain data (bytes): per rank the weights by tensor
    family, their reserve, what lives outside the allocator, the host's loading cost, every workload point's terms
    (`above_weights_bytes`, `peak_bytes`, the dominant term) and, with a GPU size, the largest batch per prompt length
    (largest_batch_answer: the caching allocator replay's, default and with expandable segments, unless not `replay`;
    the allocated bytes' bound beside it)."""
    outside_terms = outside(config, pred.strategy, pred.tp, rules)
    out_bytes = sum(outside_terms.values())
    points = [at(pred, w, out_bytes) for w in workloads]
    families = by_family(pred)
    per_rank = []
    for r in range(pred.tp):
        entry: Dict[str, Any] = {
            "rank": r,
            "weights_bytes": pred.weights[r],
            "weights_sharded_bytes": sum(f.get("sharded", [0] * pred.tp)[r] for f in families.values()),
            "weights_replicated_bytes": sum(f.get("replicated", [0] * pred.tp)[r] for f in families.values()),
            "reserve_bytes": held(pred)[r],
            **{f"{k}_bytes": v for k, v in outside_terms.items()},
            "host_private_bytes": pred.host.anon[r],
            "host_mapped_bytes": pred.host.file[r],
            "points": [point_entry(q, r) for q in points],
        }
        if points:  # the largest point's terms, flat (the grid runs in ascending order)
            entry.update({k: v for k, v in entry["points"][-1].items() if k.endswith("_bytes") or k == "dominant"})
        per_rank.append(entry)
    result: Dict[str, Any] = {
        "tp": pred.tp,
        "device": pred.strategy.device,
        "engine": pred.strategy.engine,
        "dtype": pred.strategy.dtype,
        "load": pred.strategy.load,
        "model_bytes": pred.model_bytes,
        "per_rank": per_rank,
        "weights_by_family": {k: {kind: list(v) for kind, v in f.items()} for k, f in families.items()},
        "host": {
            "node_private_bytes": pred.host.node,
            "mapped_bytes": max(pred.host.file, default=0),
            "how": pred.host.how,
        },  # fmt: skip
        "notes": list(pred.notes),
        "limit": next((q.limit for q in points if q.limit), None),
    }
    if gpu_bytes:
        result["gpu_budget_bytes"] = int(gpu_bytes)
        new = workloads[0].new_tokens if workloads else 1
        lengths = sorted({w.prompt_tokens for w in workloads}) or [1]
        result["largest_batch"] = {
            str(n): largest_batch_answer(pred, config, rules, n, new, int(gpu_bytes), out_bytes, replay)
            for n in lengths
        }
    return result


def kernel_limit(pred: Prediction, prompt: int) -> Optional[Dict[str, Any]]:
    """The largest batch the quant member's kernel takes at this prompt length ({batch, why}), where it has a limit
    on one product's output (int4's tinygemm: 2^31 elements); None where none applies. The prefill runs every token
    of the batch through the widest quantized linear of a rank at once: the MLP's up projection, a column-parallel
    rank's share of it, or a row-parallel layer's whole hidden output; a
    quantized head (quant.head) the last position of each sequence, or every position where the model's code drops
    generate's logits_to_keep, to the whole vocabulary (the row-parallel head's output)."""
    s, d = pred.strategy, pred.dims
    widest = max(-(-d.intermediate // max(pred.tp, 1)), d.hidden)
    if not s.quant_max_output or widest <= 0:
        return None
    tokens = s.quant_max_output // widest
    batch = tokens // max(prompt, 1)
    if s.quant_head and d.vocab:
        head_rows = prompt if d.full_logits and not s.last_position_logits else 1
        batch = min(batch, s.quant_max_output // d.vocab // head_rows)
    return {"batch": batch, "tokens": tokens, "widest_out": widest, "why": s.quant_max_output_why}


def largest_batch_answer(
    pred: Prediction,
    config: Mapping[str, Any],
    rules: Rules,
    prompt: int,
    new: int,
    gpu_bytes: int,
    outside_bytes: int,
    replay: bool = True,
    start: Optional[int] = None,
    logits_batch: Optional[int] = CHECK_BATCH,
) -> Dict[str, Any]:
    """The largest batch at one prompt length on a GPU of `gpu_bytes`, the one answer the plan prints and the budget
    search starts from: the caching allocator's replay of the point (dsexp.predict.fragmentation, under the GPU less
    `outside_bytes`, with the allocator setting the configuration runs) where it is replayed, else the allocated
    bytes' bound. Beside it: that bound (`allocated_bytes_bound`, the term that breaks its next batch), both allocator
    settings' replays (`replayed`), and the busiest rank's peak at the answer (`peak_bytes`: the memory model's terms
    plus what lives outside the allocator; `peak_reserved_bytes`: the replay's reserve at its peak, on the
    allocator alone). `start`: where the replay's search starts (the bound; a search's range may stop lower)."""
    bound = largest_batch(pred, prompt, new, gpu_bytes, outside_bytes)
    out: Dict[str, Any] = {
        "prompt_tokens": prompt,
        "new_tokens": new,
        "allocated_bytes_bound": bound.largest_batch,
        "breaks": bound.breaks,
    }
    setting = "expandable_segments" if pred.strategy.expandable_segments else "default"
    if replay:
        first = bound.largest_batch if start is None else start
        out["replayed"] = replayed(pred, config, rules, prompt, new, gpu_bytes - outside_bytes,
                                   {"largest_batch": first}, logits_batch)  # fmt: skip
    found = (out.get("replayed") or {}).get(setting) or {}
    answer = found.get("batch", bound.largest_batch)
    limit = kernel_limit(pred, prompt)
    if limit is not None and answer > limit["batch"]:
        answer, out["kernel_limit"] = limit["batch"], limit
    out.update(
        largest_batch=answer,
        answer_from=f"replay:{setting}" if found else "allocated_bytes_bound",
        peak_bytes=max(at(pred, cap.Workload(answer, prompt, new), outside_bytes).peak) if answer else None,
        peak_reserved_bytes=found.get("peak_reserved_bytes"),
    )
    return out


def fails_in_init(pred: Prediction, config: Mapping[str, Any], rules: Rules) -> Optional[str]:
    """Why the engine's own init refuses the model as the ranks would hold it (rules.init_fails: DeepSpeed's AutoTP
    run on the meta device as each rank); None: it gets through, or the engine has no such check."""
    return rules.init_fails(config_model(pred, config), pred.strategy, pred.tp)


def config_model(pred: Prediction, config: Mapping[str, Any]):
    """The configuration's model on the meta device, as its config names it (built once per process)."""
    return arch.meta_model(arch.model_source(dict(config), None), pred.strategy.dtype)


_RANKED: list = []  # the last replay_model asked: [(pred, config, rules), its answer]


def replay_model(pred: Prediction, config: Mapping[str, Any], rules: Rules):
    """What the replay runs on: rank 0's model as that rank holds it (built on the meta device) and its weights'
    allocations in the order they are made; (None, None, why) where the rank model cannot be traced. Made once for
    a configuration's prompt lengths in turn: the last one asked is kept (by the objects asking)."""
    if _RANKED and all(a is b for a, b in zip(_RANKED[0], (pred, config, rules))):
        return _RANKED[1]
    _RANKED[:] = [(pred, config, rules), rank_zero(pred, config, rules)]
    return _RANKED[1]


def rank_zero(pred: Prediction, config: Mapping[str, Any], rules: Rules):
    """replay_model's answer, made."""
    from dsexp.predict import fragmentation

    model = config_model(pred, config)
    ranked, why = rules.rank_model(model, pred.strategy, pred.placements, 0, pred.tp)
    if ranked is None:
        return None, None, why
    if pred.strategy.quant:  # the quantized weights as the rank quantized them, one linear at a time
        return ranked, rules.quantized_order(ranked), why
    order = rules.allocation_order(pred.strategy.engine)
    weights = (order(pred.placements, 0, pred.strategy) if order else None) or fragmentation.apply_order(model)
    return ranked, weights, why


def replayed(pred: Prediction, config: Mapping[str, Any], rules: Rules, prompt: int, new: int, cap_bytes: int,
             fit: Dict[str, Any], logits_batch: Optional[int] = CHECK_BATCH) -> Dict[str, Any]:  # fmt: skip
    """The largest batch whose point (its generate calls, traced on the meta device as the busiest rank holds the
    model) replayed through the caching allocator after the weights fits the allocator's cap (the GPU less what lives
    outside it), default and with expandable segments; or why it is not replayed. `logits_batch`: the sequences of
    the first point's logits call (None: the point's batch, as the jobs measured before the call ran the first
    sequence alone made it). Python's garbage collector is paused meanwhile (fragmentation.collector_paused): the rank
    model's copy and the searches make objects by the million."""
    from dsexp.predict import fragmentation

    with fragmentation.collector_paused():
        return replayed_paused(pred, config, rules, prompt, new, cap_bytes, fit, logits_batch)


def replayed_paused(pred: Prediction, config: Mapping[str, Any], rules: Rules, prompt: int, new: int,
                    cap_bytes: int, fit: Dict[str, Any], logits_batch: Optional[int]) -> Dict[str, Any]:  # fmt: skip
    """replayed's answer, made."""
    from dsexp.predict import fragmentation

    if not str(pred.strategy.device).startswith("cuda"):
        return {"not_replayed": "a CPU run has no caching allocator"}
    ranked, weights, why = replay_model(pred, config, rules)
    if ranked is None or not fit["largest_batch"]:
        return {"not_replayed": why or "not even batch 1 fits the allocated bytes"}
    gen = config.get("generate") or {}
    warmup, repeats = int(gen.get("warmup") or 0), int(gen.get("repeats") or 1)
    calls = fragmentation.point_calls(new, warmup, repeats, True, logits_batch)
    out: Dict[str, Any] = traced_with(config)
    structure = fragmentation.fingerprint(ranked)
    for name, expandable in (("default", False), ("expandable_segments", True)):
        try:
            batch, probes = fragmentation.largest_batch(
                ranked, weights, prompt, calls, cap_bytes, fit["largest_batch"], expandable, structure=structure
            )
        except Exception as e:  # the model's code refuses the shapes a rank holds: the bytes' answer stands
            return {"not_replayed": generate_fails(e)}
        out[name] = {"batch": batch, "replays": len(probes), "peak_reserved_bytes": next(
            (p.peak_reserved for p in probes if p.batch == batch), None)}  # fmt: skip
    return out


def generate_fails(e: Exception) -> str:
    """Why a replay stopped where the model's own code refused the shapes rank 0 holds. AutoTP's runs fail the same
    way: at tp=2, every architecture whose trace fails failed in a CPU run's generate, and every other ran
    (tests/test_plan.py against results/cpu/arch_matrix.md)."""
    first = (str(e).strip().splitlines() or [""])[0]
    return (f"its generate fails as rank 0 holds the model (traced on the meta device; a run is expected to fail "
            f"there too): {type(e).__name__}: {first}")  # fmt: skip


def traceable_under(transformers: str) -> bool:
    """Whether the generate's trace runs under this transformers: it builds the model as transformers 5 does."""
    from dsexp.core.schema import version_tuple

    return version_tuple(transformers) >= (5,)


def traced_with(config: Mapping[str, Any]) -> Dict[str, Any]:
    """The transformers the trace ran (this environment's) and, where the config's stack pins another, a note: the
    trace is transformers' own generate, and its tensors' lifetimes, so the frees the replay sees, change between
    versions (docs/FINDINGS.md 6e: 5.17 and 5.24 one batch apart at 4 x 19 GiB)."""
    here, ranks = installed("transformers"), version(config, Facts(), "transformers")
    out: Dict[str, Any] = {"traced_with": f"transformers {here}"}
    if ranks and ranks != here:
        how = (f"dsexp.plan --trace-in-stack replays under {ranks}" if traceable_under(ranks)
               else "the trace needs transformers 5: not replayed under it")  # fmt: skip
        out["version_note"] = f"the stack runs {ranks}: its generate may free in another order ({how})"
    return out


def point_entry(q: PointPrediction, rank: int) -> Dict[str, Any]:
    w = q.workload
    return {
        "batch": w.batch,
        "prompt_tokens": w.prompt_tokens,
        "new_tokens": w.new_tokens,
        **{f"{k}_bytes": v[rank] for k, v in q.terms.items()},
        "above_weights_bytes": q.above_weights(rank),
        "peak_bytes": q.peak[rank],
        "dominant": q.dominant[rank],
    }
