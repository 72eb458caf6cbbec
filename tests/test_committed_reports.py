"""Every committed report under results/ is what the code writes today from its committed results: each summary.md
is rebuilt by the command its Source line names (dsexp.analysis.committed; `make reports` runs the same check, and
`make reports ARGS=--rewrite` writes again those that differ) and compared line by line, the answer, the matrix, the
recommendation and every other section but the plot lists (no plot is drawn: the fifty reports take seconds). A
frozen campaign's report is the record of what the code said then (its campaign says why) and is the only one not
checked."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from dsexp.analysis.committed import Unchecked, differences, regenerate, reports_under
from dsexp.campaign.spec import load, names

from helpers.run import ROOT

REPORTS = reports_under(ROOT / "results")
FROZEN = [ROOT / load(n).results for n in names() if load(n).frozen]
CHECKED = [r for r in REPORTS if not any(f in r.parents for f in FROZEN)]


def report_id(report: Path) -> str:
    return str(report.relative_to(ROOT))


def test_every_report_but_a_frozen_campaigns_names_a_command_that_rebuilds_it_from_the_repository():
    assert len(CHECKED) >= 40
    unchecked = {}
    for report in CHECKED:
        try:
            regenerate(report, ROOT)
        except Unchecked as e:
            unchecked[report_id(report)] = str(e)
    assert not unchecked
    frozen = [r for r in REPORTS if r not in CHECKED]
    assert frozen
    for report in frozen:  # its Source names the folder of the machine that ran it
        with pytest.raises(Unchecked, match="is no folder of the repository"):
            regenerate(report, ROOT)


@pytest.mark.parametrize("report", CHECKED, ids=report_id)
def test_every_committed_report_is_what_the_code_writes_today(report):
    diff = differences(report, ROOT)
    assert not diff, "committed (-) and what the code writes today (+):\n" + "\n".join(diff)


def test_a_figure_edited_by_hand_is_a_difference(tmp_path):
    """The answer's per-GPU figure of gpu24_loads_tp2, edited in a copy of its folder: the check names that line,
    as committed and as the code writes it."""
    name = "results/h200/budget/gpu24_loads_tp2"
    shutil.copytree(ROOT / name, tmp_path / name, ignore=shutil.ignore_patterns("plots"))
    report = tmp_path / name / "summary.md"
    text = report.read_text()
    answer = next(line for line in text.splitlines() if line.startswith("- **Answer**: "))
    figure = answer.split("per GPU ")[1].split(" GiB")[0]
    edited = answer.replace(f"per GPU {figure} GiB", "per GPU 22.72 GiB", 1)
    assert edited != answer  # the committed figure is not the one written in by hand
    report.write_text(text.replace(answer, edited))
    changed = [line for line in differences(report, tmp_path)[2:] if not line.startswith("@@")]
    assert changed == [f"-{edited}", f"+{answer}"]


@pytest.mark.slow
def test_findings_is_what_its_template_and_the_committed_results_give_today():
    """docs/FINDINGS.md, whose tables are report sections of committed results: `make findings` would not change it."""
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "scripts/make_findings.py", "--check"], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
