"""The "budget" section: a budget search's answer (dsexp.compose.budget): the fastest correct configuration within
the budget at its largest batch, the runner-up, what the budget would need for the next tp down or twice the batch,
or, where nothing fits, which term fails first for the closest configuration; the configurations not launched and
why; every run the search made against the full grid's count."""

from __future__ import annotations

import math
import shlex
from typing import Any, Dict, List, Optional

from dsexp.analysis import budget_runs as B
from dsexp.analysis.markdown import md_table
from dsexp.analysis.sections.common import ReportInputs, size
from dsexp.core.workload import BATCH_KEY

NAME = "budget"
GIB = 2**30


def gib_setting(v: float) -> str:
    """A budget.gpu_gib value that holds v bytes (3 significant digits, rounded up)."""
    g = v / GIB
    digits = max(0, 2 - int(math.floor(math.log10(g)))) if g > 0 else 0
    return f"{math.ceil(g * 10**digits) / 10**digits:.{digits}f}"


def render(inputs: ReportInputs) -> str:
    s = inputs.search
    if not s:
        return ""
    results = {B.result_key(r.result): r.result for r in inputs.rows}
    how = B.enforcement([r.result for r in inputs.rows])
    lines = ["## Budget search", "", _budget_line(s, how if inputs.rows else "none launched"), ""]
    found = B.candidates(s, results)
    open_ = unsettled(s)
    if found:
        lines += _answer(found, s, provisional=bool(open_))
    elif open_:  # not "nothing fits": what was not yet measured may
        lines.append("- **No answer yet**: no configuration has run within the budget so far.")
    else:
        lines += _nothing_fits(s)
    lines += allocator_lines(s)
    if open_:
        lines.append(
            f"- The search was stopped before it settled {', '.join(f'`{k}`' for k in open_)} (no bracket yet): the "
            "answer holds among what was measured. Run the same command again (same hydra.sweep.dir) to resume."
        )
    lines += ["", _runs_line(s), ""] + _merged_lines(s)
    misses = [c for c in s["configs"] if c.get("miss")]
    if misses:
        lines += ["Not launched (predicted not to fit):", ""]
        lines += [f"- `{c['key']}`: {c['miss']['text']}" for c in misses] + [""]
    foreseen = [c for c in s["configs"] if c.get("fails_in_init")]
    if foreseen:
        lines += ["Not launched (the engine's init fails, run on the meta device as each rank):", ""]
        lines += [f"- `{c['key']}`: {c['fails_in_init']}" for c in foreseen] + [""]
    failed = [c for c in s["configs"] if _stopped(c)]
    if failed:
        lines += ["Stopped (not an answer):", ""] + [f"- `{c['key']}`: {c['failed']}" for c in failed] + [""]
    if any(not _not_launched(c) for c in s["configs"]):
        lines += [_runs_table(s), ""] + _replay_lines(s)
    return "\n".join(lines)


def _replay_lines(s: Dict[str, Any]) -> List[str]:
    """Where a guess was traced in its stack's overlay (another transformers than the search's), or not replayed."""
    lines = []
    for c in s["configs"]:
        replay = c.get("replay") or {}
        if replay.get("in_stack"):
            lines.append(f"- `{c['key']}`: its guess replayed under {replay['traced_with']}, in its stack's overlay")
        elif replay.get("not_in_stack"):
            lines.append(f"- `{c['key']}`: its guess replayed under {replay['traced_with']}, not its stack's "
                         f"transformers: {replay['not_in_stack']}")  # fmt: skip
        elif replay.get("not_replayed"):
            lines.append(f"- `{c['key']}`: its guess not held to the allocator's replay: {replay['not_replayed']}")
    return lines + [""] if lines else []


def expandable(config: Dict[str, Any]) -> bool:
    """A configuration that ran with expandable segments: the search's twin, or one whose overrides set them."""
    return bool(config.get("twin_of")) or any("expandable_segments" in o for o in config.get("overrides") or [])


def allocator_lines(s: Dict[str, Any]) -> List[str]:
    """Where the caching allocator's fragmentation decided a configuration's bracket: its largest batch with the
    default allocator and with expandable segments (its twin, searched too), and the environment line to use."""
    by_key = {c["key"]: c for c in s.get("configs") or []}
    out = []
    for twin in (c for c in by_key.values() if c.get("twin_of")):
        base = by_key.get(twin["twin_of"]) or {}
        got = twin.get("largest_ok")
        if got is None and not twin.get("settled"):
            continue
        still = (
            f" With them too, batch {twin.get('smallest_oom')} ran out of memory though its bytes fit."
            if twin.get("allocator_decided")
            else ""
        )
        out.append(
            f"- The allocator decided `{base.get('key')}`: batch {base.get('largest_ok')} ran with the default "
            f"caching allocator and {base.get('smallest_oom')} ran out of memory though its bytes fit the budget; with "
            f"expandable segments its largest batch is {got if got is not None else 'none'}. Set "
            "`PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True` in the ranks' environment (dsexp: "
            f"`++trim.env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`).{still}"
        )
    undecided = [c["key"] for c in by_key.values() if c.get("allocator_decided") and not expandable(c) and not any(
        t.get("twin_of") == c["key"] for t in by_key.values())]  # fmt: skip
    out += [
        f"- The allocator decided `{k}` (its first batch past the budget ran out of memory though its bytes fit): "
        "searched with the default allocator only (a user's script sets expandable segments with script.fix=context)."
        for k in undecided
    ]
    return out


def _budget_line(s: Dict[str, Any], how: Optional[str]) -> str:
    b = s["budget"]
    host = f", host {size(b['host'])}" if b.get("host") is not None else ""
    held = {
        "enforced": "enforced: each rank's allocator capped at the budget minus what its process holds outside it",
        "simulated": (
            "simulated on the CPU: each point's device need is the rank's weights plus the memory model's bytes above "
            f"them x {b.get('cpu_scale', 1.0)}, checked against the budget (no GPU allocator to cap)"
        ),
        "none launched": "not put to a run: nothing was launched",
    }.get(how or "", "compared with the measured peaks")
    return (
        f"Budget: {b['gpus']} GPUs x {size(b['device'])}{host}; prompts of {s['prompt_tokens']} tokens, "
        f"{s['new_tokens']} new tokens; batch {s['batches'][0]}..{s['batches'][-1]}. The device budget was {held}."
    )


def _candidate_line(title: str, c: B.Candidate, s: Dict[str, Any]) -> str:
    budget = s["budget"]["device"]
    peaks = [d for d in c.device if d is not None]
    per_gpu = " / ".join(size(d) for d in c.device)
    margin = size(budget - max(peaks)) if peaks else "-"
    host = ""
    if c.host is not None:
        host = f"; host {size(c.host)} over its ranks"
        if s["budget"].get("host") is not None:
            host += f" (margin {size(s['budget']['host'] - c.host)})"
    nvml = f"; NVML's process figure {' / '.join(size(v) for v in c.nvml)}" if any(c.nvml) else ""
    tps = "-" if c.tokens_per_s is None else f"{c.tokens_per_s:.1f}"
    ttft = "" if c.ttft_s is None else f", TTFT {c.ttft_s * 1000:.1f} ms"  # none for a script's calls
    return (
        f"{title}: `{c.key}` at batch **{c.batch}**: {tps} tokens/s{ttft}; per GPU {per_gpu} "
        f"(margin {margin} to the budget's {size(budget)}){nvml}{host}{quality_text(c.quality)}. "
        f"Job `{c.job}` (its folder here)."
    )


def quality_text(q: Optional[Dict[str, Any]]) -> str:
    """A quantized answer's quality cost, beside its batch (quant=: against the tp=1 run without quantization)."""
    if not q:
        return ""
    err = q.get("logits_rel_err")
    agree = q.get("token_agreement")
    verdict = "within" if q.get("passed") else "**past**"
    return (
        f"; quality against tp=1 unquantized: logits rel. err {'-' if err is None else f'{err:.3g}'} ({verdict} "
        f"{q.get('tolerance')}), greedy tokens agree {'-' if agree is None else f'{agree:.2f}'}"
    )


SHARED_RANKING = (
    "Ranked by the largest batch, then fewer GPUs, then the wider per-GPU margin, not by speed: the ranks shared "
    "one GPU over gloo, so their tokens/s and TTFT are gloo's, not a multi-GPU machine's (shown, not compared)."
)


def unsettled(s: Dict[str, Any]) -> List[str]:
    """Configurations the search meant to measure but had not bracketed when it stopped (an interrupted search)."""
    return [c["key"] for c in s["configs"] if c.get("settled") is False and not (c.get("miss") or c.get("failed"))]


def _answer(found: List[B.Candidate], s: Dict[str, Any], provisional: bool = False) -> List[str]:
    title = "**Answer so far** (search not finished)" if provisional else "**Answer**"
    lines = [f"- {_candidate_line(title, found[0], s)}"]
    command = run_it(found[0])
    if command:
        b = s["budget"]
        lines.append(f"- Run it on the budget's GPUs ({b['gpus']} x {size(b['device'])}): `{command}`")
    if len(found) > 1:
        lines.append(f"- {_candidate_line('Runner-up', found[1], s)}")
    if any(c.shared_gpu for c in found):
        lines.append(f"- {SHARED_RANKING}")
    lines += [f"- {line}" for line in _in_load(found[0]) + _what_if(found[0], s)]
    return lines


def _in_load(c: B.Candidate) -> List[str]:
    """An answer found after another point of its load: what a fresh process's first call may add."""
    if c.after is None:
        return []
    start = (
        "from the allocator's state the load left"
        if c.as_load
        else "its allocator state at the start not recorded as the load's (a job from before points recorded it)"
    )
    return [
        f"Batch {c.batch} ran after batch {c.after} in the same load, {start}: a process's first generate call "
        "reserves a little more than its later ones (80 MiB more at 43.7 GB on an H100, results/h200/point_start); "
        "where the margin above is thinner than that, confirm the batch alone in a fresh process."
    ]


def run_it(c: B.Candidate) -> Optional[str]:
    """The command that runs the answer on its own: the overrides its configuration's jobs ran with (the search's
    fixed settings included, such as a trim.env the key does not name) at its largest batch, less the budget and
    launcher.gpus (where ranks shared one GPU standing in for the budget's)."""
    overrides = c.entry.get("overrides")
    if not overrides:  # a record written before configurations kept their overrides
        return None
    dropped = ("budget.", "hydra.", "launcher.gpus=")
    kept = [o for o in overrides if not o.lstrip("+~").startswith(dropped)]
    return " ".join(["python -m dsexp", *map(shlex.quote, kept), f"{BATCH_KEY}={c.batch}"])


def _what_if(c: B.Candidate, s: Dict[str, Any]) -> List[str]:
    """The budget the next tp down and twice the batch would need (the memory model, plus the measured gap)."""
    out = []
    w = c.entry.get("what_if") or {}
    if w.get("double_batch") is not None:
        out.append(
            f"Batch {2 * c.batch} on `{c.key}` would need {size(w['double_batch'])} per GPU "
            f"(predicted, with the measured gap): budget.gpu_gib={gib_setting(w['double_batch'])}."
        )
    for tp, need in (w.get("tp_down") or {}).items():
        out.append(
            f"tp={tp} at batch {c.batch} would need {size(need)} per GPU (predicted, with the measured gap): "
            f"budget.gpus={tp} budget.gpu_gib={gib_setting(need)}."
        )
    return out


def _nothing_fits(s: Dict[str, Any]) -> List[str]:
    closest = B.closest_miss(s)
    configs = s.get("configs") or []
    stopped = [f"`{c['key']}`" for c in configs if _stopped(c)]
    if closest is None and stopped:
        return [f"- **No configuration was shown to fit**: the searches of {', '.join(stopped)} stopped (below)."]
    if closest is None and any(c.get("fails_in_init") for c in configs):
        return ["- **No configuration can run**: the engine's init fails for each one that fits the GPUs (below)."]
    if closest is None:
        return ["- **No configuration fits the budget**, and none was measured (every one takes more GPUs)."]
    why = closest["text"] or f"{closest['term']}, {size(closest['over'])} over"
    return [
        f"- **No configuration fits the budget.** Closest: `{closest['key']}`: {why}; "
        f"it needs {size(closest['over'])} more per GPU."
    ]


def _runs_line(s: Dict[str, Any]) -> str:
    jobs = s.get("jobs") or []
    walls = [j["wall_s"] for j in jobs if isinstance(j, dict) and j.get("wall_s") is not None]
    one_load = any(c.get("one_load") for c in s["configs"])
    return (
        f"Runs: {s['runs']} points in {len(jobs)} jobs, against {s['full_grid_runs']} for the full grid "
        f"({s.get('grid_configs') or len(s['configs'])} configurations x {len(s['batches'])} batches); "
        + (
            "each configuration's batch searched inside one load (a second only where a job ended before its search "
            "settled)"
            if one_load
            else f"at most {s['run_bound']} per configuration"
        )
        + (f" ({B.ONE_BATCH_PER_JOB})" if s.get("one_batch_per_job") else "")
        + (f". Jobs' wall time: {sum(walls):.0f} s." if walls else ".")
    )


def _merged_lines(s: Dict[str, Any]) -> List[str]:
    """Where several searches of one budget were read as one (dsexp.analysis.budget_merge)."""
    if not s.get("merged_from"):
        return []
    lines = [f"Read as one search from the folders {', '.join(f'`{n}`' for n in s['merged_from'])} (one budget and "
             "workload; each job below is named by its folder)."]  # fmt: skip
    if s.get("not_searched"):
        lines.append(
            f"Not in any of them (counted in the full grid, neither predicted nor run): "
            f"{', '.join(f'`{k}`' for k in s['not_searched'])}."
        )
    return lines + [""]


def _stopped(c: Dict[str, Any]) -> bool:
    """A search that ended for another cause than memory, after it launched (not one foreseen to fail in init)."""
    return bool(c.get("failed")) and not c.get("fails_in_init")


def _not_launched(c: Dict[str, Any]) -> bool:
    """Predicted not to fit, or to fail in the engine's init: the search launched nothing for it."""
    return bool(c.get("miss") or c.get("fails_in_init"))


def _runs_table(s: Dict[str, Any]) -> str:
    body = []
    for c in s["configs"]:
        if _not_launched(c):
            continue
        points = ", ".join(f"{p['batch']}:{p['status']}" for p in c.get("points") or [])
        body.append(
            [
                c["key"],
                c.get("predicted_largest") or "-",
                _shifted(c),
                c.get("largest_ok") or "-",
                c.get("smallest_oom") or "-",
                size(c.get("gap")) if c.get("gap") else "0",
                len(c.get("points") or []),
                c.get("loads", "-"),
                points or "-",
            ]
        )
    header = ["configuration", "predicted largest", "with the measured gap", "largest ran", "smallest past", "gap",
              "runs", "loads", "batch:status"]  # fmt: skip
    return md_table(header, body, [False, True, True, True, True, True, True, True, False])


def _shifted(c: Dict[str, Any]) -> str:
    """The largest batch the model says fits once shifted by the measured gap (the configuration's own, else the
    largest of its neighbours', which differ in one dimension): where the search looked next. '-' in a record
    written before the search kept it."""
    if "shift" not in c:
        return "-"
    largest = c.get("shifted_largest") or "none"
    if not c.get("shift"):
        return str(largest)
    whose = "own" if c.get("gap") else "a neighbour's"
    return f"{largest} ({whose} +{size(c['shift'])})"
