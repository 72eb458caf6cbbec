"""dsexp.plan beside llm-analysis 0.2.2 and the H200: per-GPU memory predicted from the config alone, by two tools,
against what the committed H200 runs measured.

    make benchmark NAME=plan_vs_llm_analysis   (or: .venv/bin/python benchmarks/plan_vs_llm_analysis.py)

Configurations: the committed H200 capacity grids (results/h200/capacity: Llama and InternLM2 at 20B shapes, AutoTP,
tp=1,2,4, batch x prompt tokens, 8 new tokens) and budget searches (results/h200/budget/*/budget.json: InternLM2 at
20B shapes under 4 x 24 GiB and 2 x 40 GiB, 2048-token prompts, the measured bracket of each configuration: the
largest batch that ran and the smallest that ran out of memory under the cap). For each, three figures:

- measured, from the committed result.json: weights per rank (the init census), and per point the bytes above the
  weights (torch's allocated peak of the point's prefill or decode minus the allocated bytes at init:
  dsexp.analysis.workload_points.above_weights_measured), the busiest rank;
- dsexp.plan: the sweep's own overrides composed and predicted by dsexp.compose.planning (what `python -m dsexp.plan`
  says), the busiest rank; its largest batch at the budget's GPU size with the ranks' memory outside the allocator
  (a whole H200, `gpu=h200`, for the tp=1 capacity grids);
- llm-analysis 0.2.2: LLMAnalysis(ModelConfig, GPUConfig, DtypeConfig w16a16e16, ParallelismConfig(tp_size=tp))
  .inference(batch, prompt, new): weight_memory_per_gpu; above the weights, the larger of its two checks,
  prefill_activation_memory_per_gpu and kv_cache_memory_per_gpu + decode_activation_memory_per_gpu; its largest
  batch, min(prefill_max_batch_size_per_gpu, decode_max_batch_size_per_gpu) at batch 1 on a GPUConfig of the same
  size (0 where it asserts that batch 1 does not fit).

llm-analysis's ModelConfig counts two MLP matrices of hidden x ffn_embed_dim and asserts ffn_embed_dim % hidden == 0:
a gated MLP (gate, up, down: three matrices of hidden x intermediate) is given the equivalent ffn, 3/2 x intermediate
rounded to a multiple of hidden (exact at these shapes: 24576 = 4 x 6144), and the output says so. What it cannot
represent (an untied output head, AutoTP's replicated tensors, buffers, trims, the load strategy, InternLM2's
full-prompt logits and eager attention, the caching allocator) is listed beside its figures, not made up.

llm-analysis is not a dependency of dsexp: its pins downgrade transformers in .venv. It is installed with its CLI
dependency `fire` and nothing else into the git-ignored .cache/llm-analysis, and put on sys.path here only; the
benchmark installs it so when the folder is missing:

    .venv/bin/python -m pip install --no-deps --target .cache/llm-analysis llm-analysis==0.2.2 fire

Writes results/cpu/plan_vs_llm_analysis.{json,md} (figures in bytes in the JSON). Nothing is asserted here; the plan's
equality with the report's prediction and its largest batch against the brackets are tests/test_plan_committed.py.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsexp.analysis.markdown import md_table  # noqa: E402

LLM_ANALYSIS_DIR = ROOT / ".cache" / "llm-analysis"
LLM_ANALYSIS_VERSION = "0.2.2"
H200 = ROOT / "results" / "h200"
OUT = ROOT / "results" / "cpu" / "plan_vs_llm_analysis"
GIB = 2**30
MIB = 2**20
UNBOUNDED_GIB = 1 << 20  # the GPU given to llm-analysis where only its memory figures are read (its checks pass)


def load_llm_analysis():
    """llm-analysis from .cache/llm-analysis (installed there, without its dependencies, if missing)."""
    if not (LLM_ANALYSIS_DIR / "llm_analysis").is_dir():
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--no-deps", "--target", str(LLM_ANALYSIS_DIR)]
            + [f"llm-analysis=={LLM_ANALYSIS_VERSION}", "fire", "termcolor"],
            check=True,
        )
    if str(LLM_ANALYSIS_DIR) not in sys.path:
        sys.path.append(str(LLM_ANALYSIS_DIR))  # after .venv's own packages: only llm_analysis and fire come from it
    import llm_analysis.analysis as analysis
    import llm_analysis.config as config

    version = importlib.metadata.version("llm-analysis")
    if version != LLM_ANALYSIS_VERSION:
        raise SystemExit(f"llm-analysis {version} in {LLM_ANALYSIS_DIR}, expected {LLM_ANALYSIS_VERSION}")
    logging.getLogger("__name__").setLevel(logging.ERROR)  # llm_analysis.logger's logger is named "__name__"
    return analysis, config


# --- the committed runs ---------------------------------------------------------------------------------------------


def sweep_overrides(folder: Path) -> List[str]:
    from omegaconf import OmegaConf

    return list(OmegaConf.load(folder / "multirun.yaml").hydra.overrides.task)


def job_results(folder: Path) -> Dict[int, Dict[str, Any]]:
    return {int(p.parent.name): json.loads(p.read_text()) for p in sorted(folder.glob("*/result.json"))}


def planned(overrides: List[str], multirun: bool) -> List[Dict[str, Any]]:
    from dsexp.compose.planning import plan_one, space

    entries = [plan_one(p) for p in space(overrides, multirun)]
    bad = [e for e in entries if e["status"] != "predicted"]
    if bad:
        raise SystemExit(f"dsexp.plan did not predict {[(e['configuration'], e.get('reason')) for e in bad]}")
    return entries


def measured_weights(result: Dict[str, Any]) -> Optional[int]:
    from dsexp.analysis.measured import weights_per_rank

    per_rank = weights_per_rank(result)
    return max(per_rank) if per_rank else None


def measured_points(result: Dict[str, Any]) -> List[Dict[str, Any]]:
    """Each point rank 0 listed: batch, prompt length, status, the busiest rank's bytes above the weights."""
    from dsexp.analysis.workload_points import above_weights_measured
    from dsexp.core.result import JobRecord

    ranks = list(JobRecord.of(result).ranks)
    out = []
    for entry in ranks[0].points if ranks else ():
        point = ranks[0].phase(entry["phase"]).point
        above = [above_weights_measured(rk, entry["phase"], True) for rk in ranks]
        above = [v for v in above if v is not None]
        out.append(
            {
                "batch": int(entry["batch"]),
                "prompt_tokens": int(point.get("prompt_len") or entry["prompt_tokens"]),
                "status": entry.get("status", "ok"),
                "measured_bytes": max(above) if above and entry.get("status", "ok") == "ok" else None,
            }
        )
    return out


def plan_above(entry: Dict[str, Any], batch: int, prompt: int) -> Tuple[int, str]:
    """The plan's bytes above the weights at a point, busiest rank, and its dominant term there."""
    best = None
    for rank in entry["per_rank"]:
        for p in rank["points"]:
            if (p["batch"], p["prompt_tokens"]) == (batch, prompt) and (
                best is None or p["above_weights_bytes"] > best[0]
            ):
                best = (p["above_weights_bytes"], p["dominant"])
    if best is None:
        raise KeyError(f"{entry['configuration']}: no point {batch} x {prompt} in the plan")
    return best


# --- llm-analysis ---------------------------------------------------------------------------------------------------


class LlmAnalysis:
    """llm-analysis's view of one model: its ModelConfig and what it cannot represent of the model as it ran."""

    def __init__(self, analysis, config, name: str, dims: Dict[str, Any], entry: Dict[str, Any]):
        self.analysis, self.config = analysis, config
        hidden, inter = int(dims["hidden_size"]), int(dims["intermediate_size"])
        ffn = max(1, round(1.5 * inter / hidden)) * hidden
        self.ffn = ffn
        self.model = config.ModelConfig(
            name=name,
            num_layers=int(dims["num_hidden_layers"]),
            n_head=int(dims["num_attention_heads"]),
            hidden_dim=hidden,
            vocab_size=int(dims["vocab_size"]),
            num_key_value_heads=int(dims.get("num_key_value_heads") or dims["num_attention_heads"]),
            ffn_embed_dim=ffn,
        )
        exact = "exact" if ffn * 2 == 3 * inter else f"rounded from {1.5 * inter:.0f}"
        self.mapping = (
            f"gated MLP (3 matrices of {hidden} x {inter}) given as ffn_embed_dim={ffn} (3/2 x intermediate, {exact}); "
            f"{self.model.num_layers} layers, {self.model.n_head} heads, {self.model.num_key_value_heads} KV heads, "
            f"vocab {self.model.vocab_size}; w16a16e16; flash attention (inference() does not expose another)"
        )
        self.cannot = cannot_represent(name, entry)

    def gpu(self, gib: float):
        # only mem_per_GPU_in_GB matters to the memory figures (llm-analysis multiplies it by 1024**3: GiB);
        # the rest are an H200's, for its latency figures (not used)
        return self.config.GPUConfig(
            name=f"{gib:g}GiB",
            mem_per_GPU_in_GB=gib,
            hbm_bandwidth_in_GB_per_sec=4800,
            intra_node_bandwidth_in_GB_per_sec=450,
            intra_node_min_message_latency=8e-6,
            peak_fp16_TFLOPS=989,
        )

    def inference(self, tp: int, batch: int, prompt: int, new: int, gib: float = UNBOUNDED_GIB) -> Dict[str, Any]:
        a = self.analysis.LLMAnalysis(
            self.model, self.gpu(gib), self.config.DtypeConfig(name="w16a16e16"), self.config.ParallelismConfig(tp)
        )
        return a.inference(batch_size_per_gpu=batch, seq_len=prompt, num_tokens_to_generate=new)

    def point(self, tp: int, batch: int, prompt: int, new: int) -> Dict[str, Any]:
        s = self.inference(tp, batch, prompt, new)
        kv, pre, dec = (
            s["kv_cache_memory_per_gpu"],
            s["prefill_activation_memory_per_gpu"],
            s["decode_activation_memory_per_gpu"],
        )
        return {
            "weight_memory_per_gpu": int(s["weight_memory_per_gpu"]),
            "kv_cache_memory_per_gpu": int(kv),
            "prefill_activation_memory_per_gpu": int(pre),
            "decode_activation_memory_per_gpu": int(dec),
            "above_weights_bytes": int(max(pre, kv + dec)),  # the larger of its two checks against memory_left
        }

    def largest_batch(self, tp: int, prompt: int, new: int, gib: float) -> Tuple[int, str]:
        try:
            s = self.inference(tp, 1, prompt, new, gib)
        except AssertionError as e:  # batch 1 does not fit (or the weights alone do not)
            return 0, str(e).split(" (")[0].split(",")[0]
        pre, dec = s["prefill_max_batch_size_per_gpu"], s["decode_max_batch_size_per_gpu"]
        return int(min(pre, dec)), "prefill activations" if pre <= dec else "KV cache + decode activations"


def cannot_represent(name: str, entry: Dict[str, Any]) -> List[str]:
    """What the model as it ran holds that llm-analysis has no input for (read from the plan's tensor families)."""
    fam = entry["weights_by_family"]
    heads = [k for k in fam if k.split(".")[-2] in ("lm_head", "output")]
    notes = []
    if heads:
        notes.append(
            f"an untied output head ({heads[0]}): llm-analysis counts one embedding matrix (shared with the head), so "
            "its weights leave the head out"
        )
    replicated = sum(v.get("replicated", [0])[0] for v in fam.values()) if entry["tp"] > 1 else 0
    notes.append(
        "AutoTP keeps the embedding, the norms"
        + (" and this head" if heads and "replicated" in fam[heads[0]] else "")
        + " whole on every rank"
        + (f" ({replicated / GIB:.2f} GiB at tp={entry['tp']} untrimmed)" if replicated else "")
        + "; llm-analysis divides every weight, the embedding included, by tp (Megatron), and every activation too "
        "(sequence parallelism, sp_size = tp)"
    )
    if any("rotary_emb" in k and ("cos" in k or "sin" in k) for k in fam):
        notes.append("per-layer rotary tables (buffers, 0.75 GiB at these shapes untrimmed): not counted")
    if "internlm2" in name:
        notes.append(
            "InternLM2's published code computes the logits of every prompt position in bf16 and fp32, whole on every "
            "rank, and its eager attention keeps the scores (5 copies on CUDA in bf16): llm-analysis counts B x L x "
            "vocab logits in bf16 divided by tp, and flash attention"
        )
    else:
        notes.append(
            "transformers' generate computes the last position's logits only (logits_to_keep=1): llm-analysis counts "
            "the whole prompt's (B x L x vocab / tp)"
        )
    notes.append(
        "trims, the load strategy, expandable segments: no counterpart (one figure for all); no caching allocator "
        "(rounding, segments, fragmentation), no CUDA context, no cuBLAS workspace, KV cache not held during the "
        "prefill's activations"
    )
    return notes


# --- the comparison -------------------------------------------------------------------------------------------------


def ratio(pred: Optional[float], meas: Optional[float]) -> Optional[float]:
    return round(pred / meas, 3) if pred is not None and meas else None


class Tools:
    """llm-analysis's view of each model, made once."""

    def __init__(self):
        self.la = load_llm_analysis()
        self.models: Dict[str, LlmAnalysis] = {}

    def of(self, entry: Dict[str, Any], dims: Dict[str, Any]) -> LlmAnalysis:
        if entry["model"] not in self.models:
            self.models[entry["model"]] = LlmAnalysis(*self.la, entry["model"], dims, entry)
        return self.models[entry["model"]]


def weights_row(where: Dict[str, Any], meas: Optional[int], entry: Dict[str, Any], llm: int) -> Dict[str, Any]:
    dsexp = max(r["weights_bytes"] for r in entry["per_rank"])
    return {
        **where,
        "measured_bytes": meas,
        "dsexp_bytes": dsexp,
        "llm_analysis_bytes": llm,
        "dsexp_ratio": ratio(dsexp, meas),
        "llm_analysis_ratio": ratio(llm, meas),
    }


def point_row(where: Dict[str, Any], q: Dict[str, Any], new: int, entry: Dict[str, Any], tool: LlmAnalysis):
    dsexp, dominant = plan_above(entry, q["batch"], q["prompt_tokens"])
    llm = tool.point(entry["tp"], q["batch"], q["prompt_tokens"], new)
    return {
        **where,
        "batch": q["batch"],
        "prompt_tokens": q["prompt_tokens"],
        "new_tokens": new,
        "status": q["status"],
        "measured_bytes": q["measured_bytes"],
        "dsexp_bytes": dsexp,
        "dsexp_dominant": dominant,
        "llm_analysis": llm,
        "dsexp_ratio": ratio(dsexp, q["measured_bytes"]),
        "llm_analysis_ratio": ratio(llm["above_weights_bytes"], q["measured_bytes"]),
    }


def batch_row(where, entry, tool: LlmAnalysis, length: int, new: int, ok, oom, searched=None) -> Dict[str, Any]:
    """The largest batch at one prompt length on the entry's GPU size: dsexp.plan's, llm-analysis's, the bracket."""
    gpu_gib = entry["gpu_budget_bytes"] / GIB
    lb = entry["largest_batch"][str(length)]
    llm, limit = tool.largest_batch(entry["tp"], length, new, gpu_gib)
    return {
        **where,
        "prompt_tokens": length,
        "gpu_gib": round(gpu_gib, 2),
        "largest_ok": ok,
        "smallest_oom": oom,
        "dsexp": lb["largest_batch"],
        "dsexp_breaks": lb["breaks"],
        "llm_analysis": llm,
        "llm_analysis_limit": limit,
        "search_predicted": searched,  # what the budget search's model said when it ran (budget.json)
        "dsexp_ratio": ratio(lb["largest_batch"], ok),
        "llm_analysis_ratio": ratio(llm, ok),
    }


def capacity(tools: Tools) -> Tuple[List[Dict], List[Dict], List[Dict]]:
    """The capacity grids: one job each, every point of its grid after one load."""
    weights, points, largest = [], [], []
    for folder in sorted(p.parent for p in (H200 / "capacity").glob("*/multirun.yaml")):
        overrides = sweep_overrides(folder)
        (entry,) = planned(overrides, True)
        (result,) = job_results(folder).values()
        tool = tools.of(entry, result["config"]["model"]["dims"])
        tp, new = entry["tp"], int(result["config"]["generate"]["new_tokens"])
        where = {"source": "capacity", "sweep": folder.name, "model": entry["model"], "tp": tp, "configuration": ""}
        llm_w = int(tool.inference(tp, 1, 512, new)["weight_memory_per_gpu"])
        weights.append(weights_row(where, measured_weights(result), entry, llm_w))
        mine = measured_points(result)
        points += [point_row(where, q, new, entry, tool) for q in mine]
        if tp > 1:  # the ranks shared the one H200: no per-GPU size to set a largest batch against
            continue
        (whole,) = planned(overrides + ["gpu=h200"], True)  # one rank on the whole H200
        for length in sorted({q["prompt_tokens"] for q in mine}):
            at = [q for q in mine if q["prompt_tokens"] == length]
            ok = max((q["batch"] for q in at if q["status"] == "ok"), default=None)
            oom = min((q["batch"] for q in at if q["status"] == "oom"), default=None)
            largest.append(batch_row(where, whole, tool, length, new, ok, oom))
    return weights, points, largest


def budget(tools: Tools) -> Tuple[List[Dict], List[Dict], List[Dict]]:
    """The budget searches: each configuration's bracket, and every point its jobs ran."""
    weights, points, largest = [], [], []
    seen = set()
    for folder in sorted(p.parent for p in (H200 / "budget").glob("*/budget.json")):
        search = json.loads((folder / "budget.json").read_text())
        entries = planned(sweep_overrides(folder), True)
        results = job_results(folder)
        job_config = {int(Path(j["dir"]).name): j["config"] for j in search["jobs"]}
        length, new = int(search["prompt_tokens"]), int(search["new_tokens"])
        for config in search["configs"]:
            want = {f"{k}={v}" for k, v in config["dims"].items()}
            (entry,) = [e for e in entries if want <= set(e["overrides"])]
            tool = tools.of(entry, model_dims(config))
            label, tp = budget_label(entry, config), entry["tp"]
            where = {
                "source": "budget",
                "sweep": folder.name,
                "model": entry["model"],
                "tp": tp,
                "configuration": label,
            }
            ok, oom = config["largest_ok"], config["smallest_oom"]
            largest.append(batch_row(where, entry, tool, length, new, ok, oom, config["predicted_largest"]))
            ran = {n: r for n, r in results.items() if job_config.get(n) == config["key"]}
            meas_w = max((w for w in map(measured_weights, ran.values()) if w), default=None)
            trim = label.split()[-1]
            if meas_w and (entry["model"], tp, trim) not in seen:  # the loads hold the same weights: one row
                seen.add((entry["model"], tp, trim))
                llm_w = int(tool.inference(tp, 1, length, new)["weight_memory_per_gpu"])
                weights.append(weights_row({**where, "configuration": f"{folder.name} {label}"}, meas_w, entry, llm_w))
            batches = sorted({q["batch"] for r in ran.values() for q in measured_points(r)})
            if not batches:
                continue
            at = list(config["overrides"]) + [f"generate.batch_size=[{','.join(map(str, batches))}]"]
            (at_batches,) = planned(at, False)
            for n, r in sorted(ran.items()):
                points += [
                    point_row({**where, "sweep": f"{folder.name}/{n}"}, q, new, at_batches, tool)
                    for q in measured_points(r)
                ]
    return weights, points, largest


def budget_label(entry: Dict[str, Any], config: Dict[str, Any]) -> str:
    """tp, load, the allocator's setting where the search set one, and the trim (last)."""
    expandable = any("expandable_segments" in o for o in config["overrides"])
    trim = "trim=all" if "trim=all" in config["overrides"] else "trim=none"
    return f"tp={entry['tp']} load={entry['load']}" + (" expandable_segments" if expandable else "") + f" {trim}"


def model_dims(config: Dict[str, Any]) -> Dict[str, Any]:
    """A configuration's model dims, composed from its overrides (the preset's)."""
    from dsexp.compose.planning import composed

    return dict(composed(config["overrides"]).model.dims)


def spread(values: List[Optional[float]]) -> Optional[Dict[str, float]]:
    vals = [v for v in values if v is not None]
    if not vals:
        return None
    return {"n": len(vals), "min": min(vals), "median": round(statistics.median(vals), 3), "max": max(vals)}


def summary(weights, points, largest) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    models = sorted({p["model"] for p in points})
    for tool in ("dsexp", "llm_analysis"):
        out[tool] = {
            "weights_ratio": spread([r[f"{tool}_ratio"] for r in weights]),
            "above_weights_ratio": {m: spread([p[f"{tool}_ratio"] for p in points if p["model"] == m]) for m in models},
            "largest_batch_ratio": spread([b[f"{tool}_ratio"] for b in largest]),
            "largest_at_least_largest_ok": sum(1 for b in largest if b["largest_ok"] and b[tool] >= b["largest_ok"]),
            "largest_below_smallest_oom": sum(1 for b in largest if b["smallest_oom"] and b[tool] < b["smallest_oom"]),
        }
    out["brackets_with_ok"] = sum(1 for b in largest if b["largest_ok"])
    out["brackets_with_oom"] = sum(1 for b in largest if b["smallest_oom"])
    return out


# --- the report -----------------------------------------------------------------------------------------------------


def gib(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / GIB:.2f}"


def size(v: Optional[int]) -> str:
    if v is None:
        return "-"
    return f"{v / GIB:.2f} GiB" if abs(v) >= GIB else f"{v / MIB:.0f} MiB"


def num(v) -> str:
    return "-" if v is None else (f"{v:.2f}" if isinstance(v, float) else str(v))


def section(name: str, lines: List[str]) -> List[str]:
    """A part of the .md that docs/FINDINGS.in.md takes as {{llm_analysis:NAME}} (scripts/make_findings.py)."""
    return [f"<!-- section: {name} -->", *lines, ""]


def render(data: Dict[str, Any]) -> str:
    lines = [
        "# dsexp.plan beside llm-analysis 0.2.2 and the H200",
        "",
        "<!-- written by benchmarks/plan_vs_llm_analysis.py; do not edit -->",
        "",
        "Per GPU, the busiest rank. Measured: the committed H200 runs (results/h200/capacity, results/h200/budget). "
        "dsexp.plan: `python -m dsexp.plan` of each sweep's overrides, from the config alone. llm-analysis: 0.2.2's "
        "`LLMAnalysis(...).inference(batch, prompt, new)` with the model's shapes, w16a16e16, tp; above the weights, "
        "the larger of its prefill activations and its KV cache + decode activations (its two fit checks).",
        "",
    ]
    lines += section("weights", weights_table(data["weights"]))
    lines += section("above", above_summary(data["points"]))
    lines += section("largest", largest_table(data["largest_batch"]))
    lines += section("notes", notes(data))
    lines += ["### Every point", "", *points_table(data["points"]), ""]
    return "\n".join(lines)


def weights_table(rows: List[Dict[str, Any]]) -> List[str]:
    header = ["configuration", "tp", "measured (GiB)", "dsexp.plan (GiB)", "llm-analysis (GiB)", "dsexp / measured",
              "llm-analysis / measured"]  # fmt: skip
    body = [
        [f"{r['model']} {r['configuration'] or 'capacity grid'}", r["tp"], gib(r["measured_bytes"]),
         gib(r["dsexp_bytes"]), gib(r["llm_analysis_bytes"]), num(r["dsexp_ratio"]), num(r["llm_analysis_ratio"])]
        for r in rows
    ]  # fmt: skip
    return md_table(header, body, [False] + [True] * 6).split("\n")


def above_summary(points: List[Dict[str, Any]]) -> List[str]:
    """Per configuration: its points that ran, and the range of each tool's ratio to the measured bytes."""
    groups: Dict[Tuple, List[Dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["model"], p["sweep"].split("/")[0], p["configuration"], p["tp"]), []).append(p)
    header = ["configuration", "tp", "points that ran", "measured above the weights (GiB)", "dsexp / measured",
              "llm-analysis / measured"]  # fmt: skip
    body = []
    for (model, sweep, config, tp), ps in groups.items():
        ran = [p for p in ps if p["measured_bytes"]]
        if not ran:
            continue
        meas = [p["measured_bytes"] for p in ran]
        body.append([f"{model} {sweep} {config}".rstrip(), tp, len(ran), f"{gib(min(meas))} - {gib(max(meas))}",
                     span(ran, "dsexp_ratio"), span(ran, "llm_analysis_ratio")])  # fmt: skip
    return md_table(header, body, [False, True, True, False, False, False]).split("\n")


def span(rows: List[Dict[str, Any]], key: str) -> str:
    vals = [r[key] for r in rows if r[key] is not None]
    lo, hi = min(vals), max(vals)
    return f"{lo:.3f}" if lo == hi else f"{lo:.3f} - {hi:.3f}"


def largest_table(rows: List[Dict[str, Any]]) -> List[str]:
    header = ["configuration", "GPU (GiB)", "prompt", "ran / out of memory", "dsexp.plan (next batch breaks on)",
              "llm-analysis (its limit)", "dsexp / ran", "llm-analysis / ran"]  # fmt: skip
    body = []
    skipped: Dict[Tuple, List[str]] = {}
    for b in rows:
        if b["largest_ok"] is None and b["smallest_oom"] is None:  # not launched: predicted not to fit
            llm = f"{b['llm_analysis']}" + (f" ({b['llm_analysis_limit']})" if not b["llm_analysis"] else "")
            said = (
                b["sweep"],
                b["gpu_gib"],
                b["tp"],
                f"dsexp.plan {b['dsexp']} ({b['dsexp_breaks']}), llm-analysis {llm}",
            )
            skipped.setdefault(said, []).append(b["configuration"].replace(f"tp={b['tp']} ", ""))
            continue
        where = f"{b['model']} {b['sweep']} " + (b["configuration"] or f"tp={b['tp']}")
        ran = f"{num(b['largest_ok'])} / {num(b['smallest_oom'])}"
        tools = [f"{b['dsexp']} ({b['dsexp_breaks']})", f"{b['llm_analysis']} ({b['llm_analysis_limit']})"]
        body.append([where, f"{b['gpu_gib']:g}", b["prompt_tokens"], ran, *tools, num(b["dsexp_ratio"]),
                     num(b["llm_analysis_ratio"])])  # fmt: skip
    out = md_table(header, body, [False, True, True, False, False, False, True, True]).split("\n")
    out.append("")
    out += [
        f"Not launched by the search {sweep} ({gpu:g} GiB), predicted not to fit: tp={tp} "
        f"({', '.join(configs)}): {said}."
        for (sweep, gpu, tp, said), configs in skipped.items()
    ]
    return out


def notes(data: Dict[str, Any]) -> List[str]:
    out = ["How llm-analysis was given each model, and what it cannot represent of it:", ""]
    for name, m in data["llm_analysis"]["models"].items():
        out.append(f"- **{name}**: {m['mapping']}. Not representable: " + "; ".join(m["cannot_represent"]) + ".")
    return out


def points_table(points: List[Dict[str, Any]]) -> List[str]:
    header = ["run", "configuration", "tp", "batch x prompt", "status", "measured", "dsexp.plan (dominant)",
              "llm-analysis: KV + decode / prefill", "dsexp / measured", "llm-analysis / measured"]  # fmt: skip
    body = []
    for p in points:
        llm = p["llm_analysis"]
        kv_decode = llm["kv_cache_memory_per_gpu"] + llm["decode_activation_memory_per_gpu"]
        body.append([p["sweep"], f"{p['model']} {p['configuration']}".strip(), p["tp"],
                     f"{p['batch']} x {p['prompt_tokens']}", p["status"], size(p["measured_bytes"]),
                     f"{size(p['dsexp_bytes'])} ({p['dsexp_dominant']})",
                     f"{size(kv_decode)} / {size(llm['prefill_activation_memory_per_gpu'])}", num(p["dsexp_ratio"]),
                     num(p["llm_analysis_ratio"])])  # fmt: skip
    right = [False, False, True, False, False, True, False, False, True, True]
    return md_table(header, body, right).split("\n")


def compact_json(data: Dict[str, Any]) -> str:
    """The JSON with one line per row of each table (small, and diffable row by row)."""
    parts = []
    for key, value in data.items():
        if isinstance(value, list):
            rows = ",\n".join(f"  {json.dumps(v)}" for v in value)
            parts.append(f" {json.dumps(key)}: [\n{rows}\n ]")
        else:
            parts.append(f" {json.dumps(key)}: {json.dumps(value)}")
    return "{\n" + ",\n".join(parts) + "\n}\n"


def main() -> int:
    t0 = time.perf_counter()
    tools = Tools()
    cw, cp, cl = capacity(tools)
    bw, bp, bl = budget(tools)
    weights, points, largest = cw + bw, cp + bp, cl + bl
    data = {
        "llm_analysis": {
            "version": importlib.metadata.version("llm-analysis"),
            "models": {
                name: {"ffn_embed_dim": m.ffn, "mapping": m.mapping, "cannot_represent": m.cannot}
                for name, m in tools.models.items()
            },
        },
        "summary": summary(weights, points, largest),
        "weights": weights,
        "points": points,
        "largest_batch": largest,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    text = render(data)
    OUT.with_suffix(".json").write_text(compact_json(data))
    OUT.with_suffix(".md").write_text(text)
    print(text)
    print(json.dumps(data["summary"], indent=1))
    seconds = time.perf_counter() - t0  # not written: the files change only where a figure does
    print(f"wrote {OUT.with_suffix('.json')} and {OUT.with_suffix('.md')} in {seconds:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
