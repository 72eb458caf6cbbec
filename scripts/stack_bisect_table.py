"""The version bisection as a markdown table: private host memory each rank adds while from_pretrained loads (USS
after load - USS at the end of start, which already holds the interpreter, torch and transformers), by transformers
release, and the first release from which the ranks no longer make private copies of the weights.
Usage: stack_bisect_table.py SWEEP_DIR (result.json files of scripts/cpu_stack_bisect.sh)."""

from __future__ import annotations

import sys
from pathlib import Path

from packaging.version import Version

from dsexp.analysis.sources import results_from_dir

GIB = 2**30
PRIVATE = 0.5  # a rank "copies" when loading adds private memory of more than half the model


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
        loads = [(r["phases"]["start"]["host"], r["phases"]["load"]["host"]) for r in ranks]
        out.append((version, model, res["status"], loads))
    return sorted(out, key=lambda r: Version(r[0]) if r[0][0].isdigit() else Version("99"))


def main(folder: Path) -> None:
    print(
        "| transformers | status | model (GiB) | private memory added by the load, per rank: USS (GiB) "
        "| anon (GiB) | file-backed pages mapped after load, per rank (GiB) | private copy? |"
    )
    print("|---|---|---:|---|---|---|---|")
    first_shared, copying = None, False
    for version, model, status, loads in rows(folder):
        if not loads:
            print(f"| {version} | {status} | - | - | - | - | - |")
            continue
        uss = [load["host_uss"] - start["host_uss"] for start, load in loads]
        anon = [load["host_anon"] - start["host_anon"] for start, load in loads]
        copies = max(uss) > PRIVATE * model
        if copying and not copies and first_shared is None:
            first_shared = version
        copying = copies if first_shared is None else copying
        cells = [
            version,
            status,
            f"{model / GIB:.2f}",
            " / ".join(f"{u / GIB:.2f}" for u in uss),
            " / ".join(f"{a / GIB:.2f}" for a in anon),
            " / ".join(f"{load['host_file'] / GIB:.2f}" for _, load in loads),
            "yes" if copies else "no",
        ]
        print("| " + " | ".join(cells) + " |")
    print()
    print(
        f"First release whose ranks make no private copy after a copying one: **{first_shared or 'none found'}** "
        f"(a copy: the load adds private memory (USS) of more than {PRIVATE:.0%} of the model)."
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
