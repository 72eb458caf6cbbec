"""The "scripts" section, for users' scripts: each script as written beside each fixed variant (script.fix), per rank
(device, host) and node, with the correctness verdict and what each remedy saved; the recommendation is the smallest
set of remedies that reaches the lowest per-device memory with correct output, printed as the lines to change."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from dsexp.analysis import measured as m
from dsexp.analysis.markdown import md_table
from dsexp.analysis.matrix import Row
from dsexp.analysis.script_lines import code_lines
from dsexp.analysis.sections.common import ReportInputs
from dsexp.analysis.user_script import first_call, generate_calls, is_script
from dsexp.core.remedies import CHANGES_NUMBERS

NAME = "scripts"
TIE = 0.01  # per-device figures within 1% are the same memory


def _group_key(r: Row) -> Tuple:
    """One table per script, arguments, tp, stack and launcher: the fixes of one configuration side by side (the
    same script under torchrun and under the DeepSpeed launcher is two configurations, as its label says)."""
    c = r.config
    s = c.get("script") or {}
    launcher = (c.get("launcher") or {}).get("name") or "torchrun"
    return (s.get("path"), tuple(s.get("args") or []), r.tp, (c.get("stack") or {}).get("name"), launcher)


def _fixes(r: Row) -> Tuple[str, ...]:
    return tuple((r.config.get("script") or {}).get("fix") or [])


def _applied_remedies(r: Row) -> Dict[str, Any]:
    """{remedy: what it did} as rank 0 recorded it."""
    return dict(r.record.ranks[0].fixes_applied) if r.record.ranks else {}


def _applied(r: Row) -> List[str]:
    return sorted(_applied_remedies(r))


def _device_per_rank(r: Row) -> List[Optional[float]]:
    """GPU: each rank's NVML process peak (its own, ranks sharing a GPU included); CPU: weights after the engine."""
    if r.record.on_gpu:
        return _peak_per_rank(r, "nvml_process_used_peak")
    return [rk.weights_held for rk in r.record.ranks]


def _measured(per_rank: List[Optional[float]]) -> bool:
    """Every rank has a figure, and there is a rank."""
    return bool(per_rank) and all(per_rank)


def _peak_per_rank(r: Row, key: str) -> List[Optional[int]]:
    """Per rank, a sampled peak at its highest over the phases."""
    peaks = ((ph.peaks.get(key) for ph in rk.phases()) for rk in r.record.ranks)
    return [max((v for v in vals if v is not None), default=None) for vals in peaks]


def _gibs(vals: Sequence[Optional[float]], nd: int = 2) -> str:
    return " / ".join("-" if v is None else m.human(v) for v in vals) or "-"


def _correct(r: Row) -> str:
    c = r.record.correctness
    if not c:
        return f"- ({_unchecked(r)})"
    err = c.get("logits_rel_err")
    return ("yes" if c.get("passed") else "**no**") + (f" ({err:.1e})" if err is not None else "")


def _unchecked(r: Row) -> str:
    """Why a run has no correctness verdict, in a few words (the notes under the table say more)."""
    if not (r.config.get("check") or {}).get("correctness", True):
        return "check off"
    if not r.record.ok:
        return "run failed"
    if not first_call(r.result, "generate"):
        return "no generate on rank 0"
    if (r.result.get("runtime") or {}).get("reference", {}).get("failed"):
        return "reference failed"
    return "not compared"


ONE_TIME = {
    "op_build": "DeepSpeed building its op {name}",
    "checkpoint_written": "the script writing a checkpoint to {name}",
}


NEGLIGIBLE_S = 0.05  # a cost that prints as "0.0 s" (an op built before, only loaded) says nothing


def one_time_lines(r: Row) -> List[str]:
    """Each one-time cost rank 0 paid (an op compiled, a checkpoint written), with the phase it fell in; the phase
    times in the tables leave it out. Costs under NEGLIGIBLE_S are not listed."""
    rank0 = r.record.ranks[0].script if r.record.ranks else {}
    out = []
    for e in (rank0.get("events") or []) if rank0 else []:
        if e.get("kind") != "one_time" or e.get("seconds", 0) < NEGLIGIBLE_S:
            continue
        what = ONE_TIME.get(e.get("what"), "{name}").format(name=e.get("name"))
        if e.get("what") == "op_build" and e.get("cached"):
            what = f"DeepSpeed loading its op {e.get('name')}, built before (torch's extensions cache)"
        size = f", {m.human(e['bytes'])}" if e.get("bytes") else ""
        out.append(
            f"one-time cost: {e['seconds']:.1f} s of {e.get('in_phase')} on rank 0 was {what}{size}; "
            "left out of the phase's time"
        )
    return out


def _status(r: Row) -> str:
    return "ok" if r.record.ok else f"failed: {r.record.cause}"


def _best(group: List[Row]) -> Optional[Row]:
    """Lowest per-device memory with correct output; ties within TIE go to the fewest remedies."""
    ok = [r for r in group if r.record.passed and max(_device_per_rank(r), key=lambda v: v or 0)]
    if not ok:
        return None
    low = min(max(v or 0 for v in _device_per_rank(r)) for r in ok)
    tied = [r for r in ok if max(v or 0 for v in _device_per_rank(r)) <= low * (1 + TIE)]
    return min(tied, key=lambda r: (len(_applied(r)), len(_fixes(r))))


def lines_to_change(r: Row) -> List[str]:
    """The remedies that applied, as the Python a user puts in the script (built from what the run recorded)."""
    lines = code_lines(r.result)
    if not lines and first_call(r.result, "init"):
        return ["# nothing to change: no remedy applied"]
    return lines


def render(inputs: ReportInputs) -> str:
    return "\n".join(scripts_lines(inputs.rows))


def scripts_lines(rows: List[Row]) -> List[str]:
    groups: Dict[Tuple, List[Row]] = {}
    for r in rows:
        if is_script(r.result):
            groups.setdefault(_group_key(r), []).append(r)
    if not groups:
        return []
    out = ["## Your script: as written and fixed", ""]
    for (path, args, tp, stack, launcher), group in sorted(groups.items(), key=lambda kv: str(kv[0])):
        group.sort(key=lambda r: len(_fixes(r)))
        base = next((r for r in group if not _fixes(r)), None)
        name = "/".join(str(path).split("/")[-2:]) if _same_name(groups, path) else str(path).rsplit("/", 1)[-1]
        head = (
            f"### `{name}{' ' + ' '.join(args) if args else ''}` at tp={tp}"
            + (f" on stack {stack}" if stack and stack != "current" else "")
            + (f" under launcher={launcher}" if launcher != "torchrun" else "")
        )
        if len({_batch(r) for r in group}) > 1:  # a budget search over the script's batch: one job a batch
            out += [head + ", a budget search (one job a batch)", "", _search_table(group), ""]
            out += ["Which batch fits, and with which remedies: the budget search's answer. Nothing is recommended "
                    "here across batches.", ""]  # fmt: skip
            out += _notes(group)
            continue
        out += [head, "", _table(group, base), ""]
        best = _best(group)
        if best is not None:
            which = ", ".join(_applied(best)) or "none (as written)"
            dev = max(v or 0 for v in _device_per_rank(best))
            out += [f"Recommended: **script.fix={list(_fixes(best)) or '[]'}** (remedies that applied: {which}), "
                    f"{m.human(dev)} per rank on the device, correct. Lines to change in the script:", ""]  # fmt: skip
            out += ["```python", *lines_to_change(best), "```", ""]
        else:
            out += [_no_recommendation(group), ""]
        out += _notes(group)
    return out


def _batch(r: Row) -> Any:
    return (r.config.get("generate") or {}).get("batch_size")


def _search_table(group: List[Row]) -> str:
    """A budget search's jobs of one script, by remedies then batch: no savings across batches (they are not the
    same workload)."""
    gpu = any(r.record.on_gpu for r in group)
    header = ["script.fix", "batch", "status", "correct (rel. err)", f"{'device peak' if gpu else 'device weights'} "
              "per rank", "private host memory per rank (peak)", "remedies applied"]  # fmt: skip
    body = []
    for r in sorted(group, key=lambda r: (len(_fixes(r)), _fixes(r), str(_batch(r)))):
        status = "out of memory" if r.record.cause == "oom_gpu" else _status(r)
        body.append(
            [
                ",".join(_fixes(r)) or "as written",
                str(_batch(r)),
                status,
                _correct(r),
                _gibs(_device_per_rank(r)),
                _gibs(_peak_per_rank(r, "host_anon_peak")),
                ", ".join(_applied(r)) or "-",
            ]
        )
    return md_table(header, body, [False, True, False, False, True, True, False])


def _no_recommendation(group: List[Row]) -> str:
    """Why no variant is recommended, from what the runs recorded."""
    if any(r.record.correctness for r in group):
        return "No variant ran correct here: see the diagnosis below."
    if all(_unchecked(r) == "check off" for r in group):
        return "Correctness was not checked here (check.correctness=false): no recommendation."
    if not any(r.record.ok for r in group):
        return (
            "No variant ran to the end, so none could be checked for correctness: each failure is in the table "
            "and in the diagnosis below."
        )
    return "No variant that ran to the end could be checked for correctness (why: below): no recommendation."


def _notes(group: List[Row]) -> List[str]:
    """Under the table: why a reference failed, each remedy that was asked for but did not apply, and why a fixed
    variant's tokens differ from the script as written's."""
    notes = []
    base = next((r for r in group if not _fixes(r)), None)
    for r in group:
        label = ",".join(_fixes(r)) or "as written"
        failed = ((r.result.get("runtime") or {}).get("reference") or {}).get("failed")
        if failed and not r.record.correctness and _unchecked(r) == "reference failed":
            notes.append(f"- {label}: not checked for correctness: its world-size-1 reference failed ({failed})")
        skipped = (r.record.ranks[0].script.get("fixes") or {}).get("not_applicable") if r.record.ranks else None
        for name, why in (skipped or {}).items():
            notes.append(f"- {label}: {name} not applied: {why}")
        notes += [f"- {label}: {line}" for line in one_time_lines(r)]
        notes += [f"- {label}: {line}" for line in token_notes(r, base)]
    return notes + [""] if notes else []


def _same_name(groups: Dict[Tuple, List[Row]], path: str) -> bool:
    """Two scripts of one file name in different folders: their headings name the folder too."""
    name = str(path).rsplit("/", 1)[-1]
    return len({k[0] for k in groups if str(k[0]).rsplit("/", 1)[-1] == name}) > 1


def _table(group: List[Row], base: Optional[Row]) -> str:
    gpu = any(r.record.on_gpu for r in group)
    header = [
        "script.fix",
        "status",
        "correct (rel. err)",
        f"{'device peak' if gpu else 'device weights'} per rank",
        "private host memory per rank (peak)",
        "node peak",
        "remedies applied",
        "saved per rank vs as written",
        "tokens vs as written",
    ]
    body = []
    written = _device_per_rank(base) if base is not None else []
    for r in group:
        dev = _device_per_rank(r)
        saved = "-"
        if r is not base and _measured(dev) and _measured(written):  # a job that never launched has no ranks
            saved = m.human(max(written) - max(dev))
        body.append(
            [
                ",".join(_fixes(r)) or "as written",
                _status(r),
                _correct(r),
                _gibs(dev),
                _gibs(_peak_per_rank(r, "host_anon_peak")),
                m.human(r.record.headline("node_host_peak_gib") * m.GIB)
                if r.record.headline("node_host_peak_gib")
                else "-",
                ", ".join(_applied(r)) or "-",
                saved,
                _tokens_cell(r, base),
            ]
        )
    return md_table(header, body, [False, False, False, True, True, True, False, True, False])


def first_tokens(r: Row) -> Optional[List[int]]:
    """The new tokens of the first sequence of rank 0's first generate call that returned (None: not recorded)."""
    call = next(iter(generate_calls(r.result)), None)
    return call.get("tokens") if call else None


def token_difference(r: Row, base: Optional[Row]) -> Optional[Tuple[Optional[int], int]]:
    """(index of the first token where a fixed variant's first generate differs from the script as written's (None:
    the same), tokens compared); None where either has no tokens recorded or they ran at different world sizes."""
    if base is None or r is base or r.tp != base.tp:
        return None
    mine, written = first_tokens(r), first_tokens(base)
    if not mine or not written:
        return None
    n = min(len(mine), len(written))
    return next((i for i in range(n) if mine[i] != written[i]), None), n


def _tokens_cell(r: Row, base: Optional[Row]) -> str:
    diff = token_difference(r, base)
    if diff is None:
        return "-"
    first, n = diff
    return f"same ({n} tokens)" if first is None else f"**differ** from token {first + 1} of {n}"


def token_notes(r: Row, base: Optional[Row]) -> List[str]:
    """Where a fixed variant's tokens differ from the script as written's: the remedies that applied which change the
    arithmetic (or that none did), and the first-step logits' relative error against the world-size-1 reference,
    beside the as-written run's."""
    diff = token_difference(r, base)
    if diff is None or diff[0] is None:
        return []
    causes = [f"{name} ({CHANGES_NUMBERS[name]})" for name in _applied(r) if name in CHANGES_NUMBERS]
    why = (
        "the remedies that change the arithmetic: " + "; ".join(causes)
        if causes
        else "no remedy that applied changes the arithmetic"
    )
    sampled = any((c.get("kwargs") or {}).get("do_sample") for c in generate_calls(r.result))
    err, err0 = ((x.record.correctness or {}).get("logits_rel_err") for x in (r, base))
    tol = (r.record.correctness or {}).get("tolerance")
    within = (
        f"; its first-step logits are within {err:.1e} of the world-size-1 reference"
        + (f" (as written: {err0:.1e})" if err0 is not None else "")
        + (f", tolerance {tol:.0e}" if tol is not None else "")
        if err is not None
        else ""
    )
    return [
        f"tokens differ from the script as written's from token {diff[0] + 1} of {diff[1]}: {why}"
        + (" (the script samples: do_sample=True turns a small change in the logits into other tokens)" if sampled
           else "")
        + within
    ]  # fmt: skip
