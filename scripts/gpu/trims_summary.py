"""One JSON line per job of the trims sweeps (scripts/gpu/trims.sh): what benchmarks/trims_target.py and a reader
need without unpacking the result files. Usage: python scripts/gpu/trims_summary.py SWEEPS_DIR > trims_h200.json"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dsexp.analysis import measured as m
from dsexp.analysis.labels import config_label
from dsexp.analysis.memory import predict
from dsexp.analysis.sources import results_from_dir


def summary(r: dict) -> dict:
    c = r.get("config") or {}
    out = {
        "job": r.get("job_dir"),
        "config": config_label(c),
        "tp": c.get("tp"),
        "trim": c.get("trim"),
        "status": r.get("status"),
        "cause": (r.get("failure") or {}).get("cause"),
        "correct": (r.get("correctness") or {}).get("passed"),
        "logits_rel_err": (r.get("correctness") or {}).get("logits_rel_err"),
        "weights_per_rank": m.weights_per_rank(r),
        "gpu_peak_gib": m.headline(r, "gpu_peak_gib"),
        "tokens_per_s": m.headline(r, "tokens_per_s"),
        "generate_s": m.headline(r, "generate_s"),
        "reserved_peak": max((m.gpu_max(r, ph, "gpu_reserved_peak") or 0) for ph in ("load", "init", "generate")),
        "alloc_peak": max((m.gpu_max(r, ph, "gpu_alloc_peak") or 0) for ph in ("load", "init", "generate")),
        "outside": m.outside_parts(r),
        "trims_done": (r.get("engine") or {}).get("trims"),
    }
    try:
        out["pred_weights_per_rank"] = predict(r).weights
    except Exception as e:  # the summary still carries the measurement
        out["pred_error"] = f"{type(e).__name__}: {e}"
    return out


def main(folder: str) -> None:
    rows = [summary(r) for r in results_from_dir(Path(folder))]
    json.dump(rows, sys.stdout, indent=1, default=str)
    print()


if __name__ == "__main__":
    main(sys.argv[1])
