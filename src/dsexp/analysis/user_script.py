"""A user's script, read from what its ranks did (the script workload's facts): the configuration it really ran,
for the memory model, and the causes of its memory, each with its signal and its fix.

The causes are those of the public threads (docs/user-guide.md, "Bring your own script"): every rank loading a
private host copy, the model on the GPU before the engine, kernel injection for a layer DeepSpeed has no policy
for, a `zero=` block init_inference never reads, ZeRO-3 loading without a live HfDeepSpeedConfig, several ranks on
one GPU, no engine at all, remote code that cannot generate on the stack. A rule concludes only from a measured or
recorded fact; each finding names the remedy (`script.fix`) that applies it to the script as written.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional

from dsexp.analysis import measured as m
from dsexp.core.records import phase_kind
from dsexp.core.remedies import CONTEXT_ENV
from dsexp.core.result import JobRecord
from dsexp.engines import hf_tp, init_inference, zero_inference
from dsexp.quant.check import DEAD_INT8_PATH, QUANT_INSTEAD
from dsexp.trims import MODEL_TRIMS

DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "half": "fp16", "float": "fp32"}
WHOLE = 0.9  # a placement holding this fraction of the model holds all of it
SIGNIFICANT = 256 * 2**20  # host growth means something only for a model this large (imports add ~100-200 MiB)


def is_script(result: Dict[str, Any]) -> bool:
    return bool(((result.get("config") or {}).get("script") or {}).get("path"))


def _script_of(result: Dict[str, Any], rank: int) -> Mapping[str, Any]:
    """What the script workload recorded on one rank (its calls, facts and events); empty if it has no record."""
    rk = next((r for r in JobRecord.of(result).ranks if r.rank == rank), None)
    return rk.script if rk else {}


def calls(result: Dict[str, Any], rank: int = 0) -> List[Dict[str, Any]]:
    return _script_of(result, rank).get("calls") or []


def generate_calls(result: Dict[str, Any], rank: int = 0) -> List[Dict[str, Any]]:
    """The rank's generate calls that returned (their shapes recorded: sequences, prompt_tokens, new_tokens)."""
    return [c for c in calls(result, rank) if c.get("kind") == "generate" and c.get("prompt_tokens") is not None]


def first_call(result: Dict[str, Any], kind: str, rank: int = 0) -> Optional[Dict[str, Any]]:
    return next((c for c in calls(result, rank) if c.get("kind") == kind), None)


def final_facts(result: Dict[str, Any], rank: int = 0) -> Dict[str, Any]:
    events = _script_of(result, rank).get("events") or []
    return next((e for e in events if e.get("kind") == "final" and "unread" in e), {})


def _dtype(value: Any) -> Optional[str]:
    text = str(value or "").replace("torch.", "")
    return DTYPES.get(text, text if text in ("bf16", "fp16", "fp32") else None)


_NOT_DIMS = ("model_type", "architectures", "torch_dtype", "dtype", "auto_map")


def _recorded_shapes(load: Dict[str, Any]) -> Dict[str, Any]:
    """Where the folder the script loaded is not on this machine (a report rebuilt elsewhere, e.g. from a GPU
    machine's results): the model as its config was recorded at the load (model_type and shapes), which the
    memory model rebuilds on the meta device. Empty where the folder is here or nothing was recorded."""
    config = load.get("config") or {}
    if (Path(str(load["source"])) / "config.json").is_file() or not config.get("model_type"):
        return {}
    dims = {k: v for k, v in config.items() if k not in _NOT_DIMS and isinstance(v, (int, float, bool))}
    return {"path": None, "arch": config["model_type"], "dims": dims}


def as_pipeline_result(result: Dict[str, Any]) -> Dict[str, Any]:
    """The script's run as dsexp's own configuration would describe it (for the memory model): the folder it loaded,
    the dtype, and the engine as its call was given (kernel injection and its policy, ZeRO-3 through initialize,
    transformers' tp_plan); no engine call: every tensor whole on every rank. Raises LookupError where the script
    loaded nothing dsexp can rebuild (a hub id, no load call)."""
    load, init = first_call(result, "load"), first_call(result, "init")
    if not load:
        raise LookupError("the script stopped before loading a model (no from_pretrained or pipeline call)")
    if not isinstance(load.get("source"), str):
        raise LookupError(f"the script loaded {load.get('source')!r}, not a model folder dsexp can read")
    kw = load.get("kwargs") or {}
    given = (init or {}).get("called_with") or (init or {}).get("given") or {}  # as the remedies made the call
    applied = applied_fixes(result)
    dtype = _dtype(given.get("dtype")) or _dtype(kw.get("torch_dtype") or kw.get("dtype")) or "fp32"
    model = {"name": "local", "path": load["source"], "trust_remote_code": bool(kw.get("trust_remote_code"))}
    model.update(_recorded_shapes(load))
    model["dtype"] = _dtype((load.get("config") or {}).get("dtype")) or dtype
    engine: Dict[str, Any] = {"name": "none"}
    zero: Dict[str, Any] = {"name": "none", "stage": 0, "offload": "none"}
    report: Dict[str, Any] = {}
    if init and init.get("engine") == "init_inference":  # the DeepSpeed call the script made
        policy = given.get("injection_policy")
        engine = {
            "name": init_inference.TRAITS.name,
            "kernel_inject": bool(given.get("replace_with_kernel_inject")),
            "injection_policy": policy if isinstance(policy, dict) else None,
            "max_out_tokens": int(given.get("max_out_tokens") or 1024),
        }
        report["injection_policy"] = engine["injection_policy"]
    elif init and init.get("engine") == "initialize" and (init.get("zero_stage_used") or init.get("zero_stage")) == 3:
        engine, zero = {"name": zero_inference.TRAITS.name}, {"name": "stage3", "stage": 3, "offload": "none"}
    elif kw.get("tp_plan"):
        engine = {"name": hf_tp.TRAITS.name}
    trims = ((applied.get("trims") or [{}])[-1]) if "trims" in applied else {}
    trim: Dict[str, Any] = {k: True for k in MODEL_TRIMS if k in trims}
    if "context" in applied:  # the allocator's settings the fix gave the ranks (the memory model reads them)
        trim["env"] = dict(CONTEXT_ENV)
    config = {
        **(result.get("config") or {}),
        "model": model,
        "engine": engine,
        "zero": zero,
        "load": {"name": "meta" if "meta_load" in applied else "eager", "format": "safetensors"},
        "dtype": dtype,
        "trim": trim,
    }
    return {**result, "config": config, "runtime": {**(result.get("runtime") or {}), "conversion": None},
            "engine": report}  # fmt: skip


def as_configured(result: Dict[str, Any]) -> Dict[str, Any]:
    """A user's script before it runs, as its config alone says (dsexp.engines.placement.script_as_configured)."""
    from dsexp.engines.placement import script_as_configured

    return {**result, "config": script_as_configured(result.get("config") or {})}


def applied_fixes(result: Dict[str, Any], rank: int = 0) -> Dict[str, Any]:
    """{remedy: what it did} as the rank recorded it (script.fix)."""
    return dict((_script_of(result, rank).get("fixes") or {}).get("applied") or {})


# --- causes ---------------------------------------------------------------------------------------------

Finding = Dict[str, str]


def _gib(b: Optional[float]) -> str:
    return "?" if b is None else m.human(b)


def _on_gpu_bytes(placement: Dict[str, Any]) -> int:
    return sum(v for k, v in (placement or {}).get("by_device", {}).items() if k.startswith("cuda"))


def model_on_gpu_before_engine(result: Dict[str, Any]) -> List[Finding]:
    """C2/C3/C5: the parameters were already on the GPU when the engine call began (device_map, .cuda(), .to,
    pipeline(device=...)): a whole copy per GPU before any sharding, and the engine's work on top of it."""
    init = first_call(result, "init")
    if not init:
        return []
    on_gpu = _on_gpu_bytes(init.get("placement_before") or {})
    total = (init.get("placement_before") or {}).get("bytes") or 0
    if not total or on_gpu < WHOLE * total:
        return []
    how = _how_it_got_there(result)
    return [
        _f(
            "model_on_gpu_before_engine",
            f"the whole model ({_gib(on_gpu)}) was on the GPU when {init['api']} began ({how}): every rank held a "
            "full copy on its GPU before the engine sharded anything, and the engine's own allocations came on top",
            "load it on the host and let the engine place it: drop the move / device_map (script.fix=host_load)",
        )
    ]


def _how_it_got_there(result: Dict[str, Any]) -> str:
    load = first_call(result, "load") or {}
    kw = load.get("kwargs") or {}
    if kw.get("device_map") not in (None, "cpu"):
        return f"from_pretrained(device_map={kw['device_map']!r})"
    if kw.get("device") not in (None, "cpu", -1):
        return f"pipeline(device={kw['device']!r})"
    move = first_call(result, "move")
    return f"{move['api']}({', '.join(map(str, move.get('target') or []))})" if move else "moved by the script"


def kernel_injection_without_policy(result: Dict[str, Any]) -> List[Finding]:
    """C3/C4: replace_with_kernel_inject=True for layers DeepSpeed has no kernel policy for: nothing replaced, nothing
    sharded, no error."""
    init = first_call(result, "init")
    if not init or not (init.get("given") or {}).get("replace_with_kernel_inject"):
        return []
    if init.get("kernel_policy_layers"):
        return []
    found = init.get("autotp_policy") or {}
    policy = found.get("policy")
    return [
        _f(
            "kernel_injection_without_policy",
            f"replace_with_kernel_inject=True, but DeepSpeed has no kernel policy for {init.get('model_class')}'s "
            "layers: it replaced nothing and sharded nothing, silently; every rank ran the whole model",
            "replace_with_kernel_inject=False with the AutoTP policy "
            + (f"injection_policy={policy}" if policy else "for the model's layers")
            + f" ({found.get('source') or 'none found'}) (script.fix=autotp)",
        )
    ]


def zero_block_unread(result: Dict[str, Any]) -> List[Finding]:
    """C6: a zero= block (or zero_optimization) handed to init_inference, which never reads it."""
    init = first_call(result, "init")
    given = (init or {}).get("given") or {}
    if not init or init.get("engine") != "init_inference" or "zero" not in given:
        return []
    unread = final_facts(result).get("unread")
    if unread is not None and "zero" not in unread:
        return []
    measured = "DeepSpeed never read it during init and generate" if unread is not None else "it is not read"
    return [
        _f(
            "zero_block_unread",
            f"init_inference was given zero={given['zero']}: {measured}, so ZeRO partitioned nothing",
            "drop the zero= block (ZeRO-Inference is deepspeed.initialize with stage 3) (script.fix=drop_unread)",
        )
    ]


def host_copy_per_rank(result: Dict[str, Any]) -> List[Finding]:
    """C1/C9: each rank's private host memory grew by about one model while loading."""
    load = first_call(result, "load")
    growth = m.load_growth(result, "anon")
    size = ((load or {}).get("placement_after") or {}).get("bytes")
    world = int((result.get("config") or {}).get("tp") or 1)
    if not load or not growth or not size or world < 2 or size < SIGNIFICANT:
        return []
    typical = sorted(growth)[len(growth) // 2]
    if typical < 0.8 * size:
        return []
    tp_plan = " with tp_plan" if (load.get("kwargs") or {}).get("tp_plan") else ""
    return [
        _f(
            "host_copy_per_rank",
            f"every rank loaded a whole private copy on the host{tp_plan}: {_gib(typical)} of private memory per "
            f"rank for a {_gib(size)} model, {world} copies on the node",
            "build the model on the meta device and let the engine load each rank's part from the checkpoint "
            "(script.fix=meta_load), or a transformers that maps safetensors instead of copying (>= 4.43)",
        )
    ]


def zero3_without_hf_config(result: Dict[str, Any]) -> List[Finding]:
    """C10: deepspeed.initialize with ZeRO-3, but from_pretrained ran without a live HfDeepSpeedConfig."""
    init, load = first_call(result, "init"), first_call(result, "load")
    if not init or not load or init.get("engine") != "initialize":
        return []
    if (init.get("zero_stage_used") or init.get("zero_stage")) != 3 or load.get("zero3_enabled"):
        return []
    return [
        _f(
            "zero3_loaded_whole",
            "ZeRO stage 3 ran, but from_pretrained saw no live HfDeepSpeedConfig: every rank loaded the whole model "
            "before ZeRO partitioned it",
            "create transformers.integrations.HfDeepSpeedConfig(ds_config) before from_pretrained and keep a "
            "reference to it",
        )
    ]


def ranks_on_one_gpu(result: Dict[str, Any]) -> List[Finding]:
    """C11: parameters of several ranks on the same GPU index when each rank has a GPU of its own."""
    if (result.get("runtime") or {}).get("shared_gpu"):
        return []
    devices = {}
    for rk in JobRecord.of(result).ranks:
        last = rk.script.get("calls") or []
        place = next((c.get("placement_after") for c in reversed(last) if c.get("placement_after")), None)
        if place:
            devices[rk.rank] = max(place.get("by_device", {}).items(), key=lambda kv: kv[1], default=(None, 0))[0]
    cuda = [d for d in devices.values() if d and d.startswith("cuda")]
    if len(cuda) < 2 or len(set(cuda)) == len(cuda):
        return []
    return [
        _f(
            "ranks_on_one_gpu",
            "several ranks put their model on the same GPU ("
            + ", ".join(f"rank {r}: {d}" for r, d in devices.items())
            + ")",
            'use each rank\'s own device: f"cuda:{local_rank}" (LOCAL_RANK), not "cuda" or a fixed index',
        )
    ]


def no_engine(result: Dict[str, Any]) -> List[Finding]:
    """A script that ran on every rank without an engine call (older records: its failure cause)."""
    if not result.get("no_engine_call") and (result.get("failure") or {}).get("cause") != "no_engine_call":
        return []
    return [
        _f(
            "no_engine",
            "no engine call: each rank ran the model on its own (data parallel at best), nothing was sharded",
            "call deepspeed.init_inference(model, tensor_parallel={'tp_size': world_size}, ...) on the loaded model",
        )
    ]


_CACHE_TUPLE = re.compile(r"'DynamicCache' object is not subscriptable|object of type 'DynamicCache' has no len")


def remote_code_cache(result: Dict[str, Any]) -> List[Finding]:
    """The trap of published remote code on transformers 5.17: a legacy-tuple cache indexed in generate."""
    fail = result.get("failure") or {}
    if not _CACHE_TUPLE.search(str(fail.get("message"))):
        return []
    versions = (result.get("software") or {}).get("versions") or {}
    return [
        _f(
            "remote_code_cache",
            f"the model's remote code treats past_key_values as a tuple and transformers "
            f"{versions.get('transformers', '?')} hands generate a DynamicCache",
            "run on a stack whose generate passes the legacy cache (stack=seed, transformers 4.42) or on transformers "
            ">= 5.24",
        )
    ]


def rejected_field(result: Dict[str, Any]) -> List[Finding]:
    """A config field the DeepSpeed version rejects (mics_shard_size on 0.19): the script stops before its engine."""
    fail = result.get("failure") or {}
    msg = str(fail.get("message"))
    if fail.get("cause") != "config_rejected" or "Extra inputs are not permitted" not in msg:
        return []  # another refusal (an int8 dtype: int8_dtype) is not a field's
    field = re.search(r"for (\w+)\s*\n?\s*(\w+)\s*\n?\s*Extra inputs are not permitted", msg)
    ds = ((result.get("software") or {}).get("versions") or {}).get("deepspeed", "?")
    what = f"{field.group(1)}.{field.group(2)}" if field else "a field of its config"
    return [
        _f(
            "rejected_field",
            f"DeepSpeed {ds} rejects {what} (an extra input its config no longer takes): the script stopped there",
            "drop the field (script.fix=drop_unread); init_inference never read the ZeRO block anyway",
        )
    ]


def int8_dtype(result: Dict[str, Any]) -> List[Finding]:
    """The seed-era int8 path: init_inference(dtype=torch.int8), which DeepSpeed 0.19 rejects before it runs."""
    msg = str((result.get("failure") or {}).get("message"))
    found = re.search(r"Data type (torch\.(?:u?int8|int4|float8\w*)) is not supported", msg)
    if not found:
        return []
    ds = ((result.get("software") or {}).get("versions") or {}).get("deepspeed", "?")
    return [
        _f(
            "int8_dtype",
            f"DeepSpeed {ds} rejects init_inference(dtype={found.group(1)}): {DEAD_INT8_PATH}",
            f"measure what the script wanted with dsexp's pipeline: {QUANT_INSTEAD}",
        )
    ]


def buffers_left_uninitialised(result: Dict[str, Any]) -> List[Finding]:
    """The published-code trap: non-persistent buffers (rotary tables) not finite right after the load."""
    bad = sorted({b for rk in JobRecord.of(result).ranks for c in rk.script.get("calls") or []
                  if c.get("kind") == "load" for b in c.get("nonfinite_buffers") or []})  # fmt: skip
    if not bad:
        return []
    versions = (result.get("software") or {}).get("versions") or {}
    return [
        _f(
            "buffers_uninitialised",
            f"{len(bad)} non-persistent buffers were not finite right after from_pretrained ({', '.join(bad[:4])}"
            f"{', ...' if len(bad) > 4 else ''}): the model's code computes them in __init__ only, and transformers "
            f"{versions.get('transformers', '?')} left them uninitialised",
            "recompute them from the model's own constructor after the load (script.fix=restore_buffers)",
        )
    ]


def tp_plan_on_shared_gpu(result: Dict[str, Any]) -> List[Finding]:
    """transformers' tensor parallelism (from_pretrained(tp_plan=...)) on ranks sharing a GPU, killed by a signal:
    the crash dsexp refuses its own engine=hf_tp on a shared GPU for (engines/hf_tp: SHARED_GPU_REFUSED)."""
    fail = result.get("failure") or {}
    load = first_call(result, "load") or {}
    tp_plan = (load.get("kwargs") or {}).get("tp_plan")
    shared = (result.get("runtime") or {}).get("shared_gpu")
    killed = fail.get("type") == "signal" or "killed by SIG" in str(fail.get("message"))
    if not tp_plan or not shared or not killed:
        return []
    return [
        _f(
            "tp_plan_on_shared_gpu",
            f"the script shards with transformers' tensor parallelism (from_pretrained(tp_plan={tp_plan!r})) on "
            f"ranks sharing a GPU, whose collectives go over gloo; {fail.get('message')}: the known crash of this "
            f"setting ({hf_tp.SHARED_GPU_REFUSED}), the one dsexp refuses its own engine=hf_tp on a shared GPU for",
            "give each rank a GPU of its own (as many GPUs as tp, no launcher.gpus), or shard with "
            "deepspeed.init_inference (AutoTP), which runs on ranks sharing a GPU",
        )
    ]


_ENGINE_AS_MODEL = re.compile(r"'InferenceEngine' object has no attribute '(\w+)'")


def engine_as_model(result: Dict[str, Any]) -> List[Finding]:
    """The InferenceEngine handed where transformers expects the model (`pipe.model = deepspeed.init_inference(...)`,
    as DeepSpeed's tutorial writes it): the engine forwards calls, not the model's attributes."""
    found = _ENGINE_AS_MODEL.search(str((result.get("failure") or {}).get("message")))
    if not found:
        return []
    return [
        _f(
            "engine_as_model",
            f"the script used DeepSpeed's InferenceEngine where transformers expects the model, which reads "
            f"`{found.group(1)}` from it: the engine forwards calls to the model, not its attributes",
            "use the engine's model: `deepspeed.init_inference(...).module` (e.g. `pipe.model = engine.module`)",
        )
    ]


RULES = (
    engine_as_model,
    tp_plan_on_shared_gpu,
    buffers_left_uninitialised,
    rejected_field,
    int8_dtype,
    remote_code_cache,
    no_engine,
    model_on_gpu_before_engine,
    kernel_injection_without_policy,
    zero_block_unread,
    zero3_without_hf_config,
    host_copy_per_rank,
    ranks_on_one_gpu,
)


def causes(result: Dict[str, Any]) -> List[Finding]:
    return [f for rule in RULES for f in rule(result)]


def what_it_did(result: Dict[str, Any], rank: int = 0) -> str:
    """The script's recorded calls on a rank, in order, as one sentence: each call with the arguments it gave and
    where the parameters were after it ("" when it recorded none)."""
    steps = []
    for c in calls(result, rank):
        given = c.get("kwargs") if c.get("kwargs") is not None else c.get("given")
        args = ", ".join(f"{k}={v}" for k, v in given.items()) if isinstance(given, dict) else ", ".join(given or [])
        step = f"{c.get('api')}({args})"
        where = ((c.get("placement_after") or {}).get("by_device")) or {}
        if where:
            step += " -> parameters " + ", ".join(f"{_gib(b)} on {dev}" for dev, b in sorted(where.items()))
        if c.get("new_tokens") is not None:
            step += f" -> {c['new_tokens']} new tokens"
        steps.append(step)
    return "; ".join(steps)


def _f(code: str, text: str, fix: str) -> Finding:
    return {"code": code, "text": text, "fix": fix}


def phases_reached(result: Dict[str, Any]) -> Dict[int, List[str]]:
    """Each rank's phase keys in order (a phase that happened twice appears twice: generate, generate_2)."""
    return {rk.rank: list(rk.timeline_phases) for rk in JobRecord.of(result).ranks if rk.rank is not None}


def kinds(result: Dict[str, Any]) -> List[str]:
    return sorted({phase_kind(p) for ph in phases_reached(result).values() for p in ph})
