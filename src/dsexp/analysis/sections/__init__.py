"""The sweep report's sections, one module each, in the order summary.md shows them. Each module has `NAME` (what
`python -m dsexp.report --print NAME` and the `{{report:NAME}}` placeholders of docs/FINDINGS.in.md use) and
`render(inputs) -> markdown`, heading included, or "" where the sweep has nothing for it:

    budget           budget_answer       a budget search's answer, its misses and runs
    scripts          your_script         users' scripts, as written and fixed
    script_calls     script_calls        each generate call a script made, with the model's bytes above the weights
    recommendation   recommendation      what to run, and against the memory model's floor
    matrix           matrix_table        every run: measured, predicted, speed
    capacity         capacity_fit        memory above the weights per workload point; the largest batch that fits
    latency          latency             TTFT, TPOT, e2e and tokens/s per workload point
    stacks           stack_comparison    one configuration on each software stack
    weights          weights_table       weights per rank, predicted vs measured
    trims            trim_effects        each trimmed run against the same one untrimmed
    quant            quant_table         each quantized run: its weights, the quality it costs, its speed
    predicted        predicted_tp        the memory model at tp values not run
    plan             plan_table          each configuration per rank and point, as `python -m dsexp.plan` predicts it
    diagnosis        run_findings        every run's findings
    plots            plot_links          the sweep's plots
    memory           memory_over_time    each run's memory against time
    definitions      definitions         what the figures mean
"""

from __future__ import annotations

from typing import Dict

from dsexp.analysis.sections import (
    budget_answer,
    capacity_fit,
    definitions,
    latency,
    matrix_table,
    memory_over_time,
    plan_table,
    plot_links,
    predicted_tp,
    quant_table,
    recommendation,
    run_findings,
    script_calls,
    stack_comparison,
    trim_effects,
    weights_table,
    your_script,
)
from dsexp.analysis.sections.common import ReportInputs

SECTIONS = (
    budget_answer,
    your_script,
    script_calls,
    recommendation,
    matrix_table,
    capacity_fit,
    latency,
    stack_comparison,
    weights_table,
    trim_effects,
    quant_table,
    predicted_tp,
    plan_table,
    run_findings,
    plot_links,
    memory_over_time,
    definitions,
)
NAMES = tuple(section.NAME for section in SECTIONS)
# What only a sweep means: its runs ranked or compared at the batch each ran. A budget search's runs ran at the batches
# its search chose (the lowest peak is its smallest batch; a one-load job's peak is over its out-of-memory point), so
# its report goes from the answer to the runs table, the allocator's part and the command (the budget section), then
# the per-point figures.
SWEEP_ONLY = (recommendation.NAME, matrix_table.NAME, predicted_tp.NAME, trim_effects.NAME)


def render_sections(inputs: ReportInputs) -> Dict[str, str]:
    """The report's sections by name, in order (markdown, heading included); a section with nothing to show is
    left out, and a budget search's report leaves out what only a sweep means (SWEEP_ONLY)."""
    shown = [s for s in SECTIONS if not (inputs.search and s.NAME in SWEEP_ONLY)]
    rendered = {section.NAME: section.render(inputs) for section in shown}
    return {name: text for name, text in rendered.items() if text}
