"""The plan: every configuration's memory predicted from its config alone (dsexp.predict.job.plan_entry), per rank
and per workload point, and the largest batch a GPU of the planned size holds. The same entries make the terminal
table of `python -m dsexp.plan` and the markdown section; every figure here is a prediction."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from dsexp.analysis.labels import config_label
from dsexp.analysis.markdown import md_table
from dsexp.analysis.measured import human
from dsexp.analysis.sections.common import ReportInputs

NAME = "plan"
TERMS = (
    "kv_cache",
    "kv_dequantized",
    "activations_split",
    "activations_whole",
    "logits",
    "dequantized",
    "workspace",
    "cublas_workspace",
)
OUTSIDE = ("cuda_context", "communicator")
# What an entry that has no figures says instead (dsexp.compose.planning.plan_one)
UNPREDICTED = {"not_predicted": "not predicted", "fails_in_init": "fails in init"}
# the columns' names, used wherever the text names a term (the dominant one, the one that breaks the next batch)
SHORT = {"activations_split": "act split", "activations_whole": "act whole", "cublas_workspace": "cublas",
         "kv_dequantized": "kv deq", "dequantized": "dequant", "act_quant": "act fp8",
         "cuda_context": "context", "communicator": "comm"}  # fmt: skip


def _b(v: Any) -> str:
    return "-" if v is None else human(v)


def rank_columns(entry: Dict[str, Any]) -> List[str]:
    """The per-rank columns this entry has figures for, in pipeline order."""
    r0 = entry["per_rank"][0]
    return (
        ["weights", "sharded", "replicated", "reserve"]
        + [k for k in OUTSIDE if f"{k}_bytes" in r0]
        + [k for k in TERMS if f"{k}_bytes" in r0]
        + (["above", "peak", "dominant"] if "peak_bytes" in r0 else [])
        + ["host private", "host mapped"]
    )


KEY = {"weights": "weights_bytes", "sharded": "weights_sharded_bytes", "replicated": "weights_replicated_bytes",
       "reserve": "reserve_bytes", "above": "above_weights_bytes", "peak": "peak_bytes", "dominant": "dominant",
       "host private": "host_private_bytes", "host mapped": "host_mapped_bytes"}  # fmt: skip


def cell(rank: Dict[str, Any], column: str) -> str:
    v = rank.get(KEY.get(column, f"{column}_bytes"))
    return SHORT.get(v, str(v)) if column == "dominant" else _b(v)


def table(header: List[str], rows: List[List[str]], markdown: bool) -> List[str]:
    """The first column (a name) left, the figures right: a markdown table, or aligned text for a terminal."""
    if markdown:
        return md_table(header, rows, [False] + [True] * (len(header) - 1)).split("\n")
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def line(r: List[str]) -> str:
        return "  ".join(str(x).ljust(w) if i == 0 else str(x).rjust(w) for i, (x, w) in enumerate(zip(r, widths)))

    return [line(header)] + [line(r) for r in rows]


def workload_line(entry: Dict[str, Any]) -> str:
    pts = entry["per_rank"][0]["points"]
    if not pts:
        return ""
    last = pts[-1]
    of = f" (the largest of {len(pts)} points)" if len(pts) > 1 else ""
    return f"at batch {last['batch']} x {last['prompt_tokens']} prompt + {last['new_tokens']} new tokens{of}"


def points_lines(entry: Dict[str, Any], markdown: bool) -> List[str]:
    pts = [p for p in entry["per_rank"][0]["points"]]
    if len(pts) < 2:
        return []
    rows = []
    for i, p in enumerate(pts):
        peaks = [r["points"][i]["peak_bytes"] for r in entry["per_rank"]]
        above = [r["points"][i]["above_weights_bytes"] for r in entry["per_rank"]]
        busiest = peaks.index(max(peaks))
        dom = entry["per_rank"][busiest]["points"][i]["dominant"]
        rows.append([str(p["batch"]), str(p["prompt_tokens"]), _b(max(above)), _b(max(peaks)), SHORT.get(dom, dom)])
    return table(["batch", "prompt", "above weights (busiest)", "peak per rank", "dominant"], rows, markdown)


def capacity_line(entry: Dict[str, Any]) -> str:
    """The largest batch per prompt length (the replay's where replayed: dsexp.predict.job.largest_batch_answer),
    both allocator settings, the allocated bytes' bound labelled as the bound it is, and the peak at the answer."""
    fits = entry.get("largest_batch")
    if not fits:
        return ""
    parts = [fit_text(c) for c in fits.values()]
    return f"largest batch on a {human(entry['gpu_budget_bytes'])} GPU: " + "; ".join(parts)


def fit_text(c: Dict[str, Any]) -> str:
    breaks = "" if c["breaks"] == "-" else f", the next batch breaks on {SHORT.get(c['breaks'], c['breaks'])}"
    bound = f"allocated-bytes bound {c['allocated_bytes_bound']}{breaks}"
    if c.get("kernel_limit"):
        k = c["kernel_limit"]
        kernel = f"{k['tokens']} tokens through a {k['widest_out']}-wide linear: {k['why']}"
        bound = f"the quantized kernel's limit {k['batch']}, {kernel}; {bound}"
    peak = f"; peak at {c['largest_batch']}, busiest rank: {human(c['peak_bytes'])}" if c.get("peak_bytes") else ""
    if c.get("peak_reserved_bytes"):
        peak += f", the replay reserving {human(c['peak_reserved_bytes'])}"
    head = f"L={c['prompt_tokens']} + {c['new_tokens']} new: {c['largest_batch']}"
    return f"{head} {replayed_text(c.get('replayed'), bound)}{peak}"


def replayed_text(r, bound: str) -> str:
    """How the answer was found: the caching allocator's replay (both settings; where the generate was traced),
    with the bound beside it; or the bound alone, and why it was not replayed."""
    if not r:
        return f"[{bound}; not replayed: --no-replay]"
    if "not_replayed" in r:
        return f"[{bound}; not replayed: {r['not_replayed']}]"
    d, e = r["default"]["batch"], r["expandable_segments"]["batch"]
    traced = f"; generate traced with {r['traced_with']}" if r.get("traced_with") else ""
    traced += f"; {r['version_note']}" if r.get("version_note") else ""
    return f"[replayed through the caching allocator: default {d}, expandable segments {e}; {bound}{traced}]"


def families_lines(entry: Dict[str, Any], markdown: bool, top: int) -> List[str]:
    fams = sorted(entry["weights_by_family"].items(), key=lambda kv: -sum(sum(v) for v in kv[1].values()))
    rows = [
        [f"`{name}`" if markdown else name] + [_b(sum(kinds.get(k, [0])[:1])) for k in ("sharded", "replicated")]
        for name, kinds in fams[:top]
    ]
    more = len(fams) - top
    return table(["tensor family (rank 0)", "sharded", "replicated"], rows, markdown) + (
        [f"... and {more} more families"] if more > 0 else []
    )


def entry_lines(entry: Dict[str, Any], markdown: bool) -> List[str]:
    title = f"{entry['configuration']}: {entry['model']}, tp={entry['tp']}"
    head = [f"### {title}" if markdown else f"== {title} =="]
    if entry["status"] != "predicted":
        return head + [f"{UNPREDICTED[entry['status']]}: {entry['reason']}", ""]
    cols = rank_columns(entry)
    rows = grouped_ranks(entry["per_rank"], cols)
    desc = f"{entry['engine']} on {entry['device']}, {entry['dtype']}, load={entry['load']}"
    wl = workload_line(entry)
    held = "; each term above the weights as held at the peak, 0 B where not held then" if wl else ""
    out = head + ["", model_line(entry), f"{desc}; per rank{', ' + wl if wl else ''} (predicted{held}):", ""]
    out += table(["rank"] + [SHORT.get(c, c) for c in cols], rows, markdown) + [""]
    pts = points_lines(entry, markdown)
    out += pts + ([""] if pts else [])
    host = entry["host"]
    out.append(
        f"host: {_b(host['node_private_bytes'])} private per node; page cache up to {_b(host['mapped_bytes'])} a "
        f"rank, shared by the node's ranks, at most the checkpoint; {host['how']}"
    )
    if capacity_line(entry):
        out.append(capacity_line(entry))
    if entry.get("limit"):
        out.append(f"cannot run: {entry['limit']}")
    out += [n for n in entry.get("notes") or [] if n.startswith("quant")]  # the quant member's rule (dsexp.quant)
    out += [""] + families_lines(entry, markdown, 99 if markdown else 6) + [""]
    return out


def quant_member(entry: Dict[str, Any]) -> Optional[str]:
    """`quant=<member>` where the entry's weights are a quant member's (its rule's note names it), else None."""
    return next((n.split(":", 1)[0] for n in entry.get("notes") or [] if n.startswith("quant=")), None)


def model_line(entry: Dict[str, Any]) -> str:
    """The whole model: its parameters and their bytes in the dtype the engine holds them."""
    count = entry.get("model_parameters")
    params = f"{count / 1e9:.2f} B parameters, " if count else ""
    quant = quant_member(entry)
    # a quant member's weights at their width with their scales, the tensors it leaves in the run dtype
    held = f"as {quant} stores them, the rest in {entry['dtype']}" if quant else f"in {entry['dtype']}"
    return f"model: {params}{human(entry['model_bytes'])} of weights {held} (all ranks together)"


def grouped_ranks(ranks: List[Dict[str, Any]], cols: List[str]) -> List[List[str]]:
    """One row per run of consecutive ranks whose figures are identical, named by its first and last rank."""
    groups: List[tuple] = []
    for r in ranks:
        cells = [cell(r, c) for c in cols]
        if groups and groups[-1][1] == cells:
            groups[-1][0].append(r["rank"])
        else:
            groups.append(([r["rank"]], cells))
    return [[f"{g[0]}-{g[-1]}" if len(g) > 1 else str(g[0])] + cells for g, cells in groups]


def recommendation_line(entries: List[Dict[str, Any]]) -> str:
    """The configuration that holds the most sequences per GPU at the longest prompt planned (the largest batch as
    printed: the replay's where replayed), the fewer GPUs first among equals."""
    fits = [(e, longest_fit(e)) for e in entries if e["status"] == "predicted" and longest_fit(e)]
    if not fits:  # no GPU size given: no batch to recommend
        return ""
    fits = [(e, f) for e, f in fits if f["largest_batch"]]
    if not fits:
        return "recommended: none; no configuration planned fits a batch of one on this GPU"
    e, f = max(fits, key=lambda ef: (ef[1]["largest_batch"] / ef[0]["tp"], -ef[0]["tp"]))
    expandable = ((f.get("replayed") or {}).get("expandable_segments") or {}).get("batch")
    if expandable and f.get("kernel_limit"):  # the member's kernel faults past it whatever the allocator holds
        expandable = min(expandable, f["kernel_limit"]["batch"])
    also = (f"; {expandable} with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
            if expandable and expandable != f["largest_batch"] else "")  # fmt: skip
    which = f"`{e['configuration']}`, " if len(entries) > 1 else ""
    quant = quant_member(e)
    if quant:  # memory is the plan's to say; what the member costs in the logits only a run measures
        also += f"; {quant}'s quality cost is measured by running it (the report sets it against the unquantized model)"
    return (f"recommended: {which}batch {f['largest_batch']} at {f['prompt_tokens']} prompt + {f['new_tokens']} new "
            f"tokens on {e['tp']} GPU{'s' if e['tp'] > 1 else ''} of {human(e['gpu_budget_bytes'])} "
            f"({f['largest_batch'] / e['tp']:.1f} sequences per GPU, {ANSWER_FROM[f['answer_from']]}){also}"
            )  # fmt: skip


ANSWER_FROM = {"replay:default": "by the replay, default allocator",
               "replay:expandable_segments": "by the replay, expandable segments",
               "allocated_bytes_bound": "by the allocated bytes alone, a bound"}  # fmt: skip


def longest_fit(entry: Dict[str, Any]) -> Dict[str, Any]:
    fits = entry.get("largest_batch") or {}
    return fits[max(fits, key=int)] if fits else {}


def summary_rows(entries: List[Dict[str, Any]]) -> List[List[str]]:
    lengths = sorted({n for e in entries for n in (e.get("largest_batch") or {})}, key=int)
    rows = []
    for e in entries:
        if e["status"] != "predicted":
            said = UNPREDICTED[e["status"]]
            rows.append([e["configuration"], str(e["tp"]), said, "-", "-", "-"] + ["-"] * len(lengths))
            continue
        ranks = e["per_rank"]
        peak = max((r.get("peak_bytes") for r in ranks if r.get("peak_bytes") is not None), default=None)
        above = max((r.get("above_weights_bytes") for r in ranks if "above_weights_bytes" in r), default=None)
        fits = e.get("largest_batch") or {}
        figures = [max(r["weights_bytes"] for r in ranks), above, peak, e["host"]["node_private_bytes"]]
        batches = [str(fits[n]["largest_batch"]) if n in fits else "-" for n in lengths]
        rows.append([e["configuration"], str(e["tp"])] + [_b(v) for v in figures] + batches)
    return rows


def summary_header(entries: List[Dict[str, Any]]) -> List[str]:
    lengths = sorted({n for e in entries for n in (e.get("largest_batch") or {})}, key=int)
    return ["configuration", "tp", "weights/rank", "above weights", "peak/rank", "host private/node"] + [
        f"largest batch L={n}" for n in lengths
    ]


def render_terminal(entries: List[Dict[str, Any]]) -> str:
    out: List[str] = []
    for e in entries:
        out += entry_lines(e, markdown=False)
    if len(entries) > 1:
        out += ["== all configurations (predicted, busiest rank) =="] + table(
            summary_header(entries), summary_rows(entries), markdown=False
        )
    return "\n".join(out + ([recommendation_line(entries)] if recommendation_line(entries) else []))


def render_markdown(entries: List[Dict[str, Any]]) -> str:
    out = [
        "## Plan: memory predicted from the config alone",
        "",
        "Every figure here is a prediction (dsexp.predict.job; `python -m dsexp.plan`), per rank: the weights sharded "
        "and replicated, the allocator's reserve for them, what the process holds outside the allocator, the terms "
        "above the weights at the workload, the peak, and the host memory of the loading strategy.",
        "",
    ]
    out += table(summary_header(entries), summary_rows(entries), markdown=True) + [""]
    for e in entries:
        out += entry_lines(e, markdown=True)
    return "\n".join(out)


def render(inputs: ReportInputs) -> str:
    """The sweep's own configurations as `python -m dsexp.plan` predicts them (the run's facts beside the config:
    the checkpoint it wrote, the prompt as tokenized, the versions its ranks ran)."""
    entries = [
        row_entry(row)
        for row in inputs.rows
        if row.prediction is not None and not (row.config.get("script") or {}).get("path")
    ]
    return render_markdown(entries) if entries else ""


def row_entry(row) -> Dict[str, Any]:
    from dsexp.analysis.memory import facts_of
    from dsexp.engines.placement import RULES
    from dsexp.predict.job import plan_entry, workloads_of

    config = dict(row.config)
    entry = plan_entry(row.prediction, config, RULES, workloads_of(config, facts_of(row.result)))
    return {"configuration": config_label(config), "overrides": [], "model": (config.get("model") or {}).get("name"),
            "status": "predicted", **entry}  # fmt: skip
