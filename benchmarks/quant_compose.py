"""What composes with what, from runs (issue 61): every job of the quantization campaigns (results/cpu/quant_compose:
the tiny Llama on the CPU; results/h200/quant: llama_20b_shapes on one GPU) as one table, member x engine x tp, with
its status (the library's own error where it failed), the weights per rank measured and predicted, the quality cost
against the tp=1 run without quantization and tokens/s. Written to results/quant_compose.md and between the markers
of docs/user-guide.md's Quantization section. Not a test: it reports what the committed runs say.

Usage: python benchmarks/quant_compose.py [FOLDER ...] [--no-docs]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsexp.analysis import measured as m  # noqa: E402
from dsexp.analysis.markdown import md_table  # noqa: E402
from dsexp.analysis.memory import predict  # noqa: E402
from dsexp.quant import label  # noqa: E402

FOLDERS = ("results/cpu/quant_compose", "results/h200/quant")
GUIDE = ROOT / "docs" / "user-guide.md"
START, END = "<!-- quant-compose:start -->", "<!-- quant-compose:end -->"


def results(folder: Path) -> List[Dict[str, Any]]:
    """The folder's plain runs (a budget search's jobs are its points, not a composition: left out)."""
    runs = [json.loads(p.read_text()) for p in sorted(folder.glob("*/*/result.json"))]
    return [r for r in runs if not ((r.get("config") or {}).get("budget") or {}).get("gpu_gib")]


def row(r: Dict[str, Any], where: str) -> List[str]:
    c = r["config"]
    q = c.get("quant") or {}
    weights = m.weights_per_rank(r)
    try:
        predicted = predict(r).weights
    except Exception as e:  # noqa: BLE001  (a table of what happened: the model's refusal is a cell)
        predicted = f"not predicted: {e}"[:60]
    corr = r.get("correctness") or {}
    fail = (r.get("failure") or {}).get("message") or ""
    status = "ok" if r.get("status") == "ok" else "failed: " + re.sub(r"\s+", " ", fail)[:140].replace("|", "/")
    same = "yes" if weights and weights == predicted else ("-" if not weights else "no")
    gib = 2**30 if max(weights or [0]) > 2**30 else 2**20
    unit = "GiB" if gib == 2**30 else "MiB"
    return [
        where,
        label(q) or "none",
        engine_cell(c),
        str(c["tp"]),
        status,
        " / ".join(f"{w / gib:.3f}" for w in weights) + f" {unit}" if weights else "-",
        same,
        "-" if corr.get("logits_rel_err") is None else f"{corr['logits_rel_err']:.3g}",
        "-" if corr.get("token_agreement") is None else f"{corr['token_agreement']:.2f}",
        "-" if m.headline(r, "tokens_per_s") is None else f"{m.headline(r, 'tokens_per_s'):.1f}",
    ]


def engine_cell(c: Dict[str, Any]) -> str:
    """The engine and what differs from the folder's usual run: the load, the trims, the launcher, the model (the
    CPU's tiny Llama and the GPU's llama_20b_shapes go unnamed)."""
    load = (c.get("load") or {}).get("name", "eager")
    trim = (c.get("trim") or {}).get("name")
    launcher = (c.get("launcher") or {}).get("name", "torchrun")
    model = (c.get("model") or {}).get("name")
    return (
        c["engine"]["name"]
        + ("" if load == "eager" else f", load={load}")
        + (", trim=all" if trim == "all" else "")
        + ("" if launcher == "torchrun" else f", launcher={launcher}")
        + ("" if model in ("tiny", "llama_20b_shapes", None) else f", model={model}")
    )


def table(folders: List[Path]) -> str:
    body = []
    for folder in folders:
        where = "GPU" if "h200" in str(folder) else "CPU"
        body += [row(r, where) for r in results(folder)]
    header = ["where", "quant", "engine", "tp", "status", "weights per rank", "= predicted", "logits rel. err",
              "tokens agree", "tokens/s"]  # fmt: skip
    return md_table(header, body, [False, False, False, True, False, True, False, True, True, True])


def write_docs(text: str) -> None:
    page = GUIDE.read_text()
    if START not in page or END not in page:
        raise SystemExit(f"{GUIDE}: the markers {START} / {END} are missing")
    head, rest = page.split(START, 1)
    _, tail = rest.split(END, 1)
    GUIDE.write_text(f"{head}{START}\n{text}\n{END}{tail}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folders", nargs="*", default=list(FOLDERS))
    ap.add_argument("--no-docs", action="store_true", help="write results/quant_compose.md only")
    args = ap.parse_args()
    folders = [ROOT / f for f in args.folders if (ROOT / f).is_dir()]
    text = table(folders)
    (ROOT / "results" / "quant_compose.md").write_text(
        "# What composes with what (from runs)\n\n"
        + text
        + "\n\nMade by `python benchmarks/quant_compose.py` from "
        + ", ".join(f"`{f.relative_to(ROOT)}`" for f in folders)
        + ".\n"
    )
    if not args.no_docs:
        write_docs(text)
    print(text)


if __name__ == "__main__":
    main()
