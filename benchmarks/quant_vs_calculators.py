"""Quantized weights per GPU at 20B shapes: dsexp.plan beside the calculators users try first, and the GPU where it
ran (issue 61). Not a test: it reports figures.

    make benchmark NAME=quant_vs_calculators   (or: .venv/bin/python benchmarks/quant_vs_calculators.py)

For llama_20b_shapes (InternLM2-20B's dimensions, Llama layout) and internlm2_20b_shapes with every model trim, at
tp=1 and 2, each member's weight width:
- measured: the committed GPU run of the same configuration (results/h200/quant), where there is one;
- dsexp.plan: `python -m dsexp.plan quant=<member>` (each quantized weight at its width with its scales, on each rank,
  AutoTP's cut kept; what stays in bf16);
- llm-analysis 0.2.2: LLMAnalysis(..., its dtype config w16a16e16, w8a8e16 (fp8), w8a16e16, w4a16e16, tp).inference:
  weight_memory_per_gpu (every weight but the embedding at the width, divided by tp; no scales);
- accelerate 1.x `estimate-memory --dtypes float16 int8 int4`: its own code (`calculate_maximum_sizes` of the model
  built empty, as `accelerate estimate-memory` builds it: AutoModel, no output head) divided as its command divides
  (float16 /2, int8 /4, int4 /8 of the fp32 size), per model (it has no tp) — run here on the config, no hub.
Writes results/cpu/quant_vs_calculators.{json,md}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from plan_vs_llm_analysis import LlmAnalysis, load_llm_analysis  # noqa: E402

GIB = 2**30
MEMBERS = {"none": 16, "fp8": 8, "int8_weight": 8, "int4_weight": 4}  # member -> weight bits
LLM_DTYPES = {"none": "w16a16e16", "fp8": "w8a8e16", "int8_weight": "w8a16e16", "int4_weight": "w4a16e16"}
ACCELERATE = {16: ("float16", 2), 8: ("int8", 4), 4: ("int4", 8)}  # bits -> (its dtype name, its divisor of fp32)
MODELS = {
    "llama_20b_shapes": ["model=llama_20b_shapes"],
    "internlm2_20b_shapes trim=all": ["model=internlm2_20b_shapes", "trim=all", "experiment=autotp",
                                      "engine.injection_policy=infer"],
}  # fmt: skip
OUT = ROOT / "results" / "cpu"


def plan(overrides: List[str]) -> Dict[str, Any]:
    from dsexp.compose.planning import plan_one, space

    (entry,) = [plan_one(p) for p in space(overrides, False)]
    return entry


def plan_dims(overrides: List[str]) -> Dict[str, Any]:
    from dsexp.compose.config import compose_app, to_schema

    return dict(to_schema(compose_app(overrides)).model.dims)


def accelerate_sizes(overrides: List[str]) -> Dict[int, int]:
    """accelerate's estimate-memory figures for the model: its own calculate_maximum_sizes of the model without its
    output head (accelerate builds AutoModel), in fp32, divided as its command divides per width. The model is built
    on the meta device by dsexp (its remote code included), not fetched from a hub."""
    from dataclasses import asdict

    from accelerate.utils import calculate_maximum_sizes

    from dsexp.compose.config import compose_app, to_schema
    from dsexp.predict import architecture as arch

    config = asdict(to_schema(compose_app(overrides)))
    model = arch.meta_model(arch.model_source(config, None), "fp32").get_decoder()
    total, _ = calculate_maximum_sizes(model)
    return {bits: int(total / div) for bits, (_, div) in ACCELERATE.items()}


def measured(name: str, member: str, tp: int) -> Optional[int]:
    """The committed GPU run's weights per rank (busiest), where one ran this configuration."""
    from dsexp.analysis.measured import weights_per_rank

    for p in sorted((ROOT / "results" / "h200" / "quant").glob("*/*/result.json")):
        r = json.loads(p.read_text())
        c = r["config"]
        same = c["model"]["name"] == name.split()[0] and int(c["tp"]) == tp
        same = same and (c.get("quant") or {}).get("name", "none") == member and c["engine"]["name"] == "init_inference"
        same = same and ("trim=all" in name) == ((c.get("trim") or {}).get("name") == "all")
        if same and r.get("status") == "ok" and weights_per_rank(r):
            return max(weights_per_rank(r))
    return None


def rows() -> List[Dict[str, Any]]:
    analysis, config = load_llm_analysis()
    out = []
    for name, overrides in MODELS.items():
        acc = accelerate_sizes(overrides)
        dims = plan_dims(overrides)
        for tp in (1, 2):
            for member, bits in MEMBERS.items():
                # the bytes a member would hold, also where it does not compose (int8 under AutoTP: noted)
                entry = plan([*overrides, f"tp={tp}", f"quant={member}", "quant.check_composition=false"])
                tool = LlmAnalysis(analysis, config, name, dims, entry)
                dtype = config.get_dtype_config_by_name(LLM_DTYPES[member])
                llm = tool.analysis.LLMAnalysis(tool.model, tool.gpu(1 << 20), dtype, config.ParallelismConfig(tp))
                llm = llm.inference(batch_size_per_gpu=1, seq_len=2048, num_tokens_to_generate=16)
                out.append(
                    {
                        "model": name,
                        "tp": tp,
                        "quant": member,
                        "bits": bits,
                        "measured_bytes": measured(name, member, tp),
                        "dsexp_plan_bytes": max(r["weights_bytes"] for r in entry["per_rank"]),
                        "llm_analysis_bytes": int(llm["weight_memory_per_gpu"]),
                        "accelerate_bytes": acc[bits],
                    }
                )
    return out


def render(data: List[Dict[str, Any]]) -> str:
    def g(v: Optional[int]) -> str:
        return "-" if v is None else f"{v / GIB:.2f}"

    lines = [
        "# Quantized weights per GPU: dsexp.plan beside llm-analysis, accelerate and the GPU",
        "",
        "<!-- written by benchmarks/quant_vs_calculators.py; do not edit -->",
        "",
        "Weights per GPU (GiB), the busiest rank. accelerate has no tensor parallelism: its figure is the whole model "
        "at the width (without the output head: it builds `AutoModel`). llm-analysis counts every weight at the "
        "width, divided by tp, without scales. dsexp.plan stores each quantized weight with its scales on each rank "
        "and keeps the output head, the embeddings and the norms in bf16 (torchao's members).",
        "",
        "| model | tp | quant | bits | measured | dsexp.plan | llm-analysis | accelerate |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in data:
        lines.append(
            f"| {r['model']} | {r['tp']} | {r['quant']} | {r['bits']} | {g(r['measured_bytes'])} | "
            f"{g(r['dsexp_plan_bytes'])} | {g(r['llm_analysis_bytes'])} | {g(r['accelerate_bytes'])} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    data = rows()
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "quant_vs_calculators.json").write_text(json.dumps(data, indent=1) + "\n")
    text = render(data)
    (OUT / "quant_vs_calculators.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
