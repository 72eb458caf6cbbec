"""The "diagnosis" section: every run's findings (dsexp.analysis.diagnosis), problems first, under its label."""

from __future__ import annotations

from typing import List

from dsexp.analysis.matrix import Row
from dsexp.analysis.sections.common import ReportInputs

NAME = "diagnosis"


def render(inputs: ReportInputs) -> str:
    lines = ["## Diagnosis", ""]
    for r in inputs.rows:
        lines += [f"### `{r.label}`", ""] + _items(r) + [""]
    return "\n".join(lines)


def _items(r: Row) -> List[str]:
    items = [f"- {'**problem**: ' if f.severity == 'problem' else ''}{sentence(f.text)}" for f in r.findings]
    return items or [f"- no diagnosis: {r.model_error or 'no measurements'}."]


def sentence(text: str) -> str:
    """The finding as a sentence: a full stop added, unless its text (an error's own message) ends in one."""
    return text if text.endswith((".", "!", "?")) else text + "."
