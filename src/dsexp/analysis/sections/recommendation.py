"""The "recommendation" section: the lowest per-device figure that passed correctness (without offloading weights
when that differs), the lowest host and node figures, the memory model's figures at tp values not run for the
recommended configurations, the trims' view, and each recommended run against the memory model's floor."""

from __future__ import annotations

from typing import List

from dsexp.analysis import measured as m
from dsexp.analysis import workload_points as capa
from dsexp.analysis.diagnosis import floor_terms
from dsexp.analysis.matrix import Extrapolated, Pick, Row, main_model, recommend
from dsexp.analysis.memory import workload_floor
from dsexp.analysis.sections.common import ReportInputs, num, on_gpu
from dsexp.analysis.sections.trim_effects import trim_lines
from dsexp.analysis.user_script import generate_calls, is_script
from dsexp.core.workload import as_list

NAME = "recommendation"
FLOOR_MARGIN = 0.05  # a recommended peak within 5% of the memory model's floor leaves nothing big unexplained
OTHER_PICKS = (
    ("host", "Lowest host peak per rank that passed correctness"),
    ("node", "Lowest node host peak that passed correctness"),
)


def render(inputs: ReportInputs) -> str:
    lines = recommendation_lines(inputs.rows, inputs.extra)
    return "\n".join(["## Recommendation", ""] + [f"- {line}" for line in lines] + [""])


def recommendation_lines(rows: List[Row], extra: List[Extrapolated]) -> List[str]:
    picks = recommend(rows)
    gpu = on_gpu(rows)
    best, plain = picks["per_device"], picks["per_device_no_offload"]
    if best is None:
        return ["No configuration passed the correctness check: nothing to recommend."]
    lines = _per_device_lines(best, plain, gpu)
    lines += [workload_line((plain or best).row)]
    others = sorted({r.config.get("model", {}).get("name") for r in rows} - {main_model(rows)})
    if others:
        lines.insert(
            0,
            f"Runs of `{main_model(rows)}` compared; other models are left out of the recommendation "
            f"({', '.join(f'`{o}`' for o in others)}).",
        )
    for strategy in dict.fromkeys(pick.row.strategy for pick in (best, plain) if pick):
        lines += _predicted_line(strategy, extra, gpu)
    lines += [_pick_line(title, picks[key], gpu, "") for key, title in OTHER_PICKS if picks[key] is not None]
    recommended = dict.fromkeys(pick.row.label for pick in picks.values() if pick)
    rows_by_label = {r.label: r for r in rows}
    lines += trim_lines(rows)
    return lines + [line for label in recommended for line in _floor_check(rows_by_label[label])]


def workload_line(row: Row) -> str:
    """The workload the recommendation holds for: its memory and speed were measured at this shape only (a user's
    script: the shapes its generate calls had, not dsexp's generate settings, which it never reads)."""
    if is_script(row.result):
        return _script_workload_line(row)
    g = row.config.get("generate") or {}
    batches, prompts = as_list(g.get("batch_size", 1)), as_list(g.get("prompt_tokens"))
    lengths = [q.prompt_tokens for q in capa.point_rows([row])]
    if prompts == [None]:
        prompt = f"the prompt text ({max(lengths)} tokens)" if lengths else "the prompt text"
    else:
        prompt = f"a prompt of {', '.join(map(str, prompts))} tokens"
    grid = " (a grid: the figures are its largest point that ran)" if len(batches) * len(prompts) > 1 else ""
    if g.get("bisect_from") is not None:  # a batch search: the batches it ran, not its range
        tried = sorted({q.batch for q in capa.point_rows([row]) if q.status in ("ok", "oom")})
        batches, grid = tried or batches, " (a batch search: the figures are its largest batch that ran)"
    return (
        f"It holds for the workload it was measured at: batch {', '.join(map(str, batches))}, {prompt}, "
        f"{g.get('new_tokens')} new tokens{grid}; a larger batch or context needs what the capacity section shows."
    )


def _script_workload_line(row: Row) -> str:
    shapes = dict.fromkeys(
        f"batch {c.get('sequences', 1)}, a prompt of {c['prompt_tokens']} tokens, {c['new_tokens']} new tokens"
        for c in generate_calls(row.result)
    )
    if not shapes:
        return "It holds for what the script ran, which made no generate call that returned."
    return (
        f"It holds for the workload the script ran (its generate calls): {'; '.join(shapes)}; a larger batch or "
        "context needs what the capacity section shows."
    )


CPU_FIGURE = "device-resident weights per rank (CPU run: no GPU, the rank's device is the host)"


def _what(gpu: bool) -> str:
    return "per-GPU peak" if gpu else CPU_FIGURE


def _per_device_lines(best: Pick, plain: Pick, gpu: bool) -> List[str]:
    """The recommended configuration; where the lowest figure offloads weights to the host, the best one that does
    not is recommended and the offload one shown with what it costs (speed, host memory)."""
    what = _what(gpu)

    def title(rest: str) -> str:
        return f"**Recommended (lowest {what} {rest})"

    if plain is None or plain.row is best.row:
        return [_pick_line(title("that passed correctness"), best, gpu, "**")]
    a, b = best.row.values(), plain.row.values()
    return [
        _pick_line(
            title(
                "without offloading weights to the host, passed correctness; ties within 1% broken by host peak "
                "per rank"
            ),
            plain,
            gpu,
            "**",
        ),
        _pick_line(f"Lowest {what} of all (weights offloaded to host memory)", best, gpu, ""),
        f"What the offload costs against the recommended configuration: host peak "
        f"{num(a['host_peak_gib'])} vs {num(b['host_peak_gib'])} GiB per rank, node "
        f"{num(a['node_host_peak_gib'])} vs {num(b['node_host_peak_gib'])} GiB, tokens/s "
        f"{num(a['tokens_per_s'], 1)} vs {num(b['tokens_per_s'], 1)}.",
    ]


def _predicted_line(strategy: str, extra: List[Extrapolated], gpu: bool) -> List[str]:
    """The memory model's figures for a recommended configuration at the tp values the sweep did not run."""
    ahead = [e for e in extra if e.strategy == strategy and not e.measured and e.per_device_gib is not None]
    if not ahead:
        return []
    return [
        f"Predicted for `{strategy}`: "
        + "; ".join(
            f"tp={e.tp}: {m.human(e.per_device_gib * m.GIB)} per {'GPU' if gpu else 'rank'}, "
            f"host {num(e.host_peak_gib)} GiB per rank, node {num(e.node_host_peak_gib)} GiB"
            for e in ahead
        )
        + "."
    ]


def _pick_line(title: str, pick: Pick, gpu: bool, close: str) -> str:
    """One recommendation with its figures and, when several runs tie within 1%, how the tie was broken."""
    r, v = pick.row, pick.row.values()
    line = (
        f"{title}: `{r.strategy}` at tp={r.tp}{close}: {m.human(m.per_device_gib(r.record) * m.GIB)} per "
        f"{'GPU' if gpu else 'rank'}, host peak {num(v['host_peak_gib'])} GiB per rank, node "
        f"{num(v['node_host_peak_gib'])} GiB, {num(v['tokens_per_s'], 1)} tokens/s; logits rel. err "
        f"{num(v['logits_rel_err'], 4)}."
    )
    if len(pick.tied) > 1:
        line += (
            f" {len(pick.tied)} runs tie within 1%; the lowest host peak per rank wins: "
            + ", ".join(f"`{t.label}` {num(t.values()['host_peak_gib'])} GiB" for t in pick.tied)
            + "."
        )
    return line


def _floor_check(row: Row) -> List[str]:
    """The recommended run's per-GPU peak against the memory model's floor at its largest workload point."""
    p, peak = row.prediction, m.headline(row.record, "gpu_peak_gib")
    floor = workload_floor(row.result, p) if p is not None and m.on_gpu(row.record) else None
    if floor is None or peak is None:
        return []
    over = peak * m.GIB / floor["bytes"] - 1
    return [
        f"`{row.label}`: per-GPU peak {peak:.2f} GiB vs the memory model's floor {floor['bytes'] / m.GIB:.2f} GiB "
        f"at batch {floor['batch']} ({floor_terms(floor)}): {over:+.1%} over the floor, "
        f"{'within' if over <= FLOOR_MARGIN else 'beyond'} "
        f"{FLOOR_MARGIN:.0%}."
        + (
            " The floor counts the partition each GPU keeps; ZeRO-3 also gathers parameters "
            "onto the GPU for each layer it runs, a working set the memory model does not size."
            if p.strategy.zero_stage == 3 and over > FLOOR_MARGIN
            else ""
        )
    ]
