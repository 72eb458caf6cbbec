"""Markdown tables for the report's sections."""

from __future__ import annotations

from typing import Any, Sequence


def md_table(header: Sequence[str], body: Sequence[Sequence[Any]], right: Sequence[bool]) -> str:
    """A GitHub markdown table; numeric columns right-aligned. Cells are already formatted strings."""

    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---:" if r else "---" for r in right) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in body]
    return "\n".join(lines)
