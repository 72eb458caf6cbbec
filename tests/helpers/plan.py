"""`python -m dsexp.plan` in-process, as the tests call it."""

from __future__ import annotations

import json

from dsexp.compose.planning import main


def plan(capsys, tmp_path, *overrides):
    """(exit status, the JSON's configurations, the terminal text, stderr) of `python -m dsexp.plan` in-process."""
    out = tmp_path / "plan.json"
    status = main(["--json", str(out), *overrides])
    text = capsys.readouterr()
    entries = json.loads(out.read_text())["configurations"] if out.is_file() else []
    return status, entries, text.out, text.err
