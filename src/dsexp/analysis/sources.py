"""Where a report's runs come from: result.json files under a folder (from MLflow: dsexp.tracking.readback)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, List

from dsexp.core.fs import read_json


def results_from_dir(folder: Path) -> List[Dict[str, Any]]:
    """Every result.json below `folder` (a sweep, or a folder of sweeps), in job order."""
    paths = [p for p in Path(folder).rglob("result.json") if ".dsexp" not in p.parts]
    paths.sort(key=lambda p: (str(p.parent.parent), len(p.parent.name), p.parent.name))
    return [r for r in (read_json(p) for p in paths) if r]
