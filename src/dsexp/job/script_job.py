"""The job side of the script workload: a user's script's facts before launch, its world-size-1 reference, and
how a script that never reached an engine is recorded.

The ranks run the script as written (dsexp.rank.workloads.script); `{model_dir}` in its arguments is the model
group's checkpoint folder. Its correctness reference is the same script, with the same remedies (script.fix), at
world size 1: rank 0's first-step logits of its first generate, cached by everything that decides them. A tp=1 job
is its own reference (its logits are cached when it ends ok); a reference that fails does not stop the job, whose
own run then shows why (the seed's script is rejected by today's DeepSpeed at every world size).
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.core.fs import file_lock, read_json
from dsexp.core.protocol import logits_file, rank_file, write_job_file
from dsexp.core.schema import BudgetConfig, JobConfig, fill_args

ENGINE_CALLS = ("init",)  # the phases an engine call opens (deepspeed.init_inference / initialize)


def digest(path: str) -> str:
    return hashlib.sha1(Path(path).read_bytes()).hexdigest()[:16]


def facts(spec: JobConfig, runtime: Dict[str, Any]) -> Dict[str, Any]:
    """The script as the ranks will run it: its path and content digest, its arguments with their placeholders
    filled in ({model_dir}, {batch_size}, {prompt_tokens}, {new_tokens}: JobConfig.script_values), and the folder it
    runs in (where dsexp was launched, as the user would run it)."""
    values = spec.script_values(runtime.get("model_dir", ""))
    return {
        "path": spec.script.path,
        "name": Path(spec.script.path).name,
        "sha1": digest(spec.script.path),
        "argv": fill_args(spec.script.args, values),
        "cwd": os.getcwd(),
    }


def reference_path(spec: JobConfig, runtime: Dict[str, Any]) -> Path:
    """Where the world-size-1 logits of this script, its arguments, remedies, software and device are cached."""
    script = runtime["script"]
    stack = runtime.get("stack") or {}
    key = json.dumps(
        [script["sha1"], script["argv"], sorted(spec.script.fix), spec.script.max_new_tokens, stack.get("key"),
         runtime["device"], runtime.get("model_dir")],
    )  # fmt: skip
    tag = hashlib.sha1(key.encode()).hexdigest()[:12]
    return Path(spec.cache_dir).expanduser() / "refs" / f"script-{Path(script['path']).stem}-{tag}.pt"


def ensure_reference(spec: JobConfig, runtime: Dict[str, Any], job_dir: Path) -> Optional[Path]:
    """The cached world-size-1 logits of this script (run now if missing); None at tp=1 (the job is its own
    reference) and when the reference run fails or saves no logits (runtime["reference"] says why)."""
    path = reference_path(spec, runtime)
    runtime["reference"] = {"path": str(path)}
    if spec.tp == 1:
        return None
    with file_lock(Path(str(path) + ".lock")):
        if path.is_file():
            runtime["reference_cache_hit"] = True
            return path
        from dsexp.job.launch import run_ranks

        ref_dir = Path(job_dir) / "reference"
        ref_dir.mkdir(parents=True, exist_ok=True)
        one = reference_spec(spec)
        write_job_file(ref_dir, one, runtime)
        outcome = run_ranks(one, ref_dir, runtime["device"], stack=runtime.get("stack"), script=runtime["script"])
        rec = read_json(rank_file(ref_dir, 0)) or {}
        if outcome.returncode != 0 or not logits_file(ref_dir).is_file():
            error = rec.get("error") or {}
            runtime["reference"]["failed"] = (
                f"{error.get('type')} in {error.get('phase')}: {error.get('message')}"
                if error
                else "the script saved no first-step logits (no generate call on rank 0)"
            )[:1000]
            return None
        runtime["reference_cache_hit"] = False
        return store_reference(ref_dir, path)


def reference_spec(spec: JobConfig) -> JobConfig:
    """The job's script at world size 1, on one node, with a GPU of its own."""
    one = copy.deepcopy(spec)
    one.tp, one.launcher.nodes, one.launcher.hostfile, one.launcher.gpus = 1, 1, None, None
    one.launcher.name, one.fault = "torchrun", None
    one.budget = BudgetConfig()  # the reference is the job's tool, not the configuration: no budget holds it
    return one


def store_reference(run_dir: Path, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    shutil.copyfile(logits_file(run_dir), tmp)
    tmp.replace(path)
    return path


def check_output(spec: JobConfig, job_dir: Path, runtime: Dict[str, Any], ref: Optional[Path]) -> Optional[dict]:
    """rank 0's first-step logits against the world-size-1 reference, by the dtype's tolerance (a sampling script
    is compared on these logits, not on its sampled text). A tp=1 run that ended ok becomes the reference."""
    from dsexp.job.correctness import TOLERANCE, compare

    logits = logits_file(job_dir)
    if not logits.is_file() or not spec.check.correctness:  # check.correctness=false: nothing to compare or keep
        return None
    if spec.tp == 1:
        store_reference(job_dir, Path(runtime["reference"]["path"]))
        return {"passed": True, "logits_rel_err": 0.0, "reference": "itself (world size 1)"}
    if ref is None:
        return None
    import torch

    out = compare(torch.load(logits), {"first_logits": torch.load(ref)}, [], spec.dtype, spec.check.rel_err_tol)
    out.setdefault("tolerance", spec.check.rel_err_tol or TOLERANCE[spec.dtype])
    return out


def no_engine_call(spec: JobConfig, ranks: List[Optional[dict]]) -> Optional[Dict[str, Any]]:
    """A script whose ranks made no engine call (None where one did): a fact of an ok run, not a failure. Each rank
    ran the model on its own and nothing was sharded; the diagnosis names the call that would shard it."""
    calls = [((rk or {}).get("script") or {}).get("calls") or [] for rk in ranks]
    if any(_is_engine(c) for cs in calls for c in cs):
        return None
    kinds = ", ".join(sorted({c.get("api", c.get("kind")) for cs in calls for c in cs})) or "nothing dsexp observes"
    return {
        "message": (
            f"the script made no engine call (deepspeed.init_inference, deepspeed.initialize, "
            f"from_pretrained(tp_plan=...)) on any of its {spec.tp} ranks; it called: {kinds}"
        ),
    }


def _is_engine(call: Dict[str, Any]) -> bool:
    return call.get("kind") in ENGINE_CALLS or bool((call.get("kwargs") or {}).get("tp_plan"))


def new_tokens(ranks: List[Optional[dict]]) -> int:
    """Tokens rank 0's first generate call made (kept for records written before generation_speed)."""
    calls = (((ranks[0] or {}).get("script") or {}).get("calls") or []) if ranks else []
    return next((int(c.get("new_tokens") or 0) for c in calls if c.get("phase") == "generate"), 0)


def generation_speed(ranks: List[Optional[dict]]) -> Dict[str, Optional[float]]:
    """The script's generation as the headline gives it: generate_s, the time of every generate call rank 0 made
    (each the slowest rank's), and tokens_per_s, every sequence's new tokens over that time (a batch of 4 x 20
    new tokens is 80). None where a generate call never ended (a rank failed or was killed in it)."""
    rank0 = (ranks[0] or {}) if ranks else {}
    gens = [c for c in (rank0.get("script") or {}).get("calls") or [] if c.get("kind") == "generate"]
    if not gens or any("error" in c or "generated_tokens" not in c for c in gens):
        return {"generate_s": None, "tokens_per_s": None, "generated_tokens": None}
    seconds = 0.0
    for c in gens:
        walls = [phase_seconds(rk or {}, c["phase"]) for rk in ranks]
        seconds += max((w for w in walls if w is not None), default=0.0)
    tokens = sum(int(c["generated_tokens"]) for c in gens)
    return {"generate_s": seconds, "tokens_per_s": tokens / seconds if seconds else None, "generated_tokens": tokens}


def weights_held_gib(ranks: List[Optional[dict]]) -> Optional[float]:
    """The most weights a rank held on its device, for a script with no init phase (as it left its model)."""
    from dsexp.core.result import RankRecord

    held = [RankRecord(rk).weights_held for rk in ranks if rk]
    held = [w for w in held if w is not None]
    return max(held) / 2**30 if held else None


def one_time_costs(rank: Optional[dict]) -> List[Dict[str, Any]]:
    """The one-time costs a rank recorded (an op DeepSpeed built, a checkpoint written), each with its phase."""
    events = (((rank or {}).get("script") or {}).get("events")) or []
    return [e for e in events if e.get("kind") == "one_time"]


def phase_seconds(rank: dict, phase: str) -> Optional[float]:
    """A phase's wall time less the one-time costs paid inside it (shown apart)."""
    wall = ((rank.get("phases") or {}).get(phase) or {}).get("wall_s")
    if wall is None:
        return None
    return max(0.0, wall - sum(e["seconds"] for e in one_time_costs(rank) if e.get("in_phase") == phase))


def without_one_time(headline: Dict[str, Any], ranks: List[Optional[dict]]) -> None:
    """load_s and init_s without the one-time costs paid in them; one_time_s: the most a rank paid in all."""
    paid = [sum(e["seconds"] for e in one_time_costs(rk)) for rk in ranks if rk]
    headline["one_time_s"] = max(paid) if any(paid) else None
    for phase in ("load", "init"):
        if headline.get(f"{phase}_s") is not None:
            walls = [phase_seconds(rk, phase) for rk in ranks if rk]
            headline[f"{phase}_s"] = max((w for w in walls if w is not None), default=None)
