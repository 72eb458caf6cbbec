"""A committed report against what the code writes today from the same results. Every summary.md names the command
that writes it again (its Source line: `python -m dsexp.report FOLDER... [--out FOLDER]`, paths from the repository's
root); that command, run now without drawing plots (dsexp.analysis.summary.text_report), must give the committed text,
its plot and memory-over-time sections (lists of plot files) aside. A report whose command writes elsewhere, or reads
folders that are not there, cannot be checked, and says so."""

from __future__ import annotations

import difflib
import re
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import List, Tuple

from dsexp.analysis.summary import HEADING, text_report

SOURCE = re.compile(r"^Source: `([^`]*)`", re.M)
FILE_SECTIONS = ("## Plots", "## Memory over time")  # what text_report leaves out: the plots it does not draw


class Unchecked(Exception):
    """A committed report whose own command does not rebuild it from the repository (its reason)."""


@dataclass(frozen=True)
class Regenerate:
    """A report's command: the folders it reads, where it writes, and the source its Source line names."""

    folders: Tuple[Path, ...]
    out: Path
    source: str


def reports_under(folder: Path) -> List[Path]:
    """Every report of dsexp below `folder` (summary*.md files that start as write_report writes them)."""
    found = sorted(Path(folder).rglob("summary*.md"))
    return [p for p in found if p.read_text().startswith(HEADING + "\n")]


def regenerate(report: Path, root: Path) -> Regenerate:
    """The command that writes `report` again, from its Source line; Unchecked if it would read folders that are not
    in `root` or write a report other than this one."""
    match = SOURCE.search(report.read_text())
    if not match:
        raise Unchecked("it has no Source line")
    argv = shlex.split(match.group(1))
    out = argv[argv.index("--out") + 1] if "--out" in argv else None
    names = [a for i, a in enumerate(argv) if not a.startswith("--") and (i == 0 or argv[i - 1] != "--out")]
    folders = tuple(root / n for n in names)
    missing = [n for n, f in zip(names, folders) if Path(n).is_absolute() or not f.is_dir()]
    if missing or not folders:
        raise Unchecked(f"its source `{match.group(1)}` is no folder of the repository ({', '.join(missing)})")
    target = root / out if out else folders[0]
    if report != target / "summary.md":
        raise Unchecked(f"its command `{match.group(1)}` writes {target.relative_to(root)}/summary.md, not it")
    return Regenerate(folders, target, match.group(1))


def rebuilt(command: Regenerate) -> str:
    """The report its command writes today, plots aside (several folders: budget searches read as one)."""
    if len(command.folders) == 1:
        return text_report(command.folders[0], command.source)
    from dsexp.analysis.budget_merge import read_merged

    search, results = read_merged(list(command.folders))
    return text_report(command.out, command.source, results=results, search=search)


def without_file_sections(text: str) -> str:
    """The report without its plot and memory-over-time sections (each from its heading to the next section)."""
    kept, skipping = [], False
    for line in text.splitlines():
        if line.startswith("## "):
            skipping = line.startswith(FILE_SECTIONS)
        if not skipping:
            kept.append(line)
    return "\n".join(kept)


def differences(report: Path, root: Path, context: int = 0) -> List[str]:
    """The committed report's lines that today's code writes otherwise, as a unified diff (committed -, today +);
    [] when they agree. Unchecked when its command cannot rebuild it."""
    today = without_file_sections(rebuilt(regenerate(report, root)))
    committed = without_file_sections(report.read_text())
    name = str(report.relative_to(root))
    diff = difflib.unified_diff(committed.splitlines(), today.splitlines(), name, "today", lineterm="", n=context)
    return list(diff)
