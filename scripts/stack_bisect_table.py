"""The version bisection as a markdown table: private host memory per rank after from_pretrained, by transformers
release, and the first release from which the ranks no longer hold private copies of the weights.
Usage: stack_bisect_table.py SWEEP_DIR (result.json files of scripts/cpu_stack_bisect.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.version import Version

from dsexp.analysis.sources import results_from_dir

GIB = 2**30
PRIVATE = 0.5  # a rank "copies" when its private memory after load exceeds half the model


def rows(folder: Path):
    out = []
    for res in results_from_dir(folder):
        ranks = [r for r in res.get("ranks") or [] if r]
        version = ((res.get("software") or {}).get("versions") or {}).get("transformers")
        if not ranks or version is None:
            failure = res.get("failure") or {}
            out.append((res["config"]["stack"].get("transformers") or "job env", None, failure.get("cause"), []))
            continue
        model = (ranks[0]["phases"]["load"].get("weights") or {}).get("param_bytes", {}).get("cpu", 0)
        loads = [r["phases"]["load"]["host"] for r in ranks]
        out.append((version, model, res["status"], loads))
    return sorted(out, key=lambda r: Version(r[0]) if r[0][0].isdigit() else Version("99"))


def main(folder: Path) -> None:
    print(
        "| transformers | status | model (GiB) | USS per rank after load (GiB) | private (anon) per rank (GiB) "
        "| file-backed per rank (GiB) | private copy? |"
    )
    print("|---|---|---:|---|---|---|---|")
    first_shared, copying = None, False
    for version, model, status, loads in rows(folder):
        if not loads:
            print(f"| {version} | {status} | - | - | - | - | - |")
            continue
        uss = [h["host_uss"] for h in loads]
        copies = max(uss) > PRIVATE * model
        if copying and not copies and first_shared is None:
            first_shared = version
        copying = copies if first_shared is None else copying
        cells = [
            version,
            status,
            f"{model / GIB:.2f}",
            " / ".join(f"{u / GIB:.2f}" for u in uss),
            " / ".join(f"{h['host_anon'] / GIB:.2f}" for h in loads),
            " / ".join(f"{h['host_file'] / GIB:.2f}" for h in loads),
            "yes" if copies else "no",
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        f"First release whose ranks hold no private copy after a copying one: **{first_shared or 'none found'}** "
        f"(private = USS after load above {PRIVATE:.0%} of the model)."
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
