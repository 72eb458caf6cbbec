"""The "memory" section: each run's memory against time, per rank, with its phases (failed runs too: up to where
their ranks got); no section when no run left a timeline."""

from __future__ import annotations

from dsexp.analysis.sections.common import PLOTS, ReportInputs, status_word

NAME = "memory"
MEMORY_NOTE = (
    "Per rank, what the background sampler read (every `probe.sample_ms`, 20 ms by default), kept where a value "
    "moved by more than 0.2% (1 MiB at least) or a second passed, with every phase's peak reading: host RSS and its"
    " private (anonymous) part, on a GPU NVML's device and process figures and torch's reserved and allocated; "
    "below, the node's used memory (every process on the machine). Shaded: the rank's phases (hatched: the one a "
    "rank died in)."
)
TRACE_NOTE = (
    "Each job's folder also holds `trace.json`, the same curves and phases as a Chrome trace (a track per rank, "
    "phases as slices, memory as counters): open it in https://ui.perfetto.dev (Open trace file) or chrome://tracing; "
    "it is in the job's MLflow run too."
)


def render(inputs: ReportInputs) -> str:
    if not inputs.memory:
        return ""
    out = ["## Memory over time", "", MEMORY_NOTE, "", TRACE_NOTE, ""]
    for i, path in inputs.memory.items():
        r = inputs.rows[i]
        out += [f"### `{r.label}` ({status_word(r.record)})", "", f"![memory over time]({PLOTS}/{path.name})", ""]
    return "\n".join(out)
