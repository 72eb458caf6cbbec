"""Benchmark (not a test) with its target: at internlm2_20b_shapes tp=2 a correct trimmed configuration reaches
<= 20.6 GiB NVML peak per GPU, at tokens/s >= transformers TP's (measured on llama_20b_shapes, the same dimensions
in the Llama layout, which has a TP plan).

This script predicts that peak before any tp=2 trimmed run exists, from committed results only:
- weights per rank at tp=2 with every model trim: the memory model (dsexp.analysis.memory; exact on CPU);
- the rest of the per-GPU peak is anchored on the committed untrimmed AutoTP run at tp=2 (results/h200x2/sweeps:
  allocator peak above the weights, memory outside the allocator, the device's own reserve), minus what each
  setting saved in the tp=1 runs of campaign trims (results/h200/trims: the outside-allocator attribution
  per rank, part by part, against the untrimmed baseline):
  * trim.world_group: the load+init growth outside the allocator at tp=2 (DeepSpeed's own communicator) less the
    same growth at tp=1 (kernels only, no group is made at tp=1);
  * NCCL_MAX_NCHANNELS: the 1-rank communicator's cost per channel and fixed part, from the tp=1 runs with and
    without the setting (64 channels at 1 rank, the NCCL default there), applied to the tp=2 world communicator's
    measured size; connection buffers made on first use (generate) are left as measured (a conservative choice);
  * the other settings (allocator, cuBLAS, CUDA module loading): their tp=1 saving per part, carried over as is;
  * a setting is used only if it passed correctness and generate slowed by less than 5% at tp=1.
Usage: python benchmarks/trims_target.py [--trims results/h200/trims] [--tp2 results/h200x2/sweeps] [--out FILE.md]
Without GPU results yet it says so, shows the memory model's part, and exits 0.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsexp.analysis import measured as m  # noqa: E402
from dsexp.analysis.memory import predict  # noqa: E402
from dsexp.analysis.sources import results_from_dir  # noqa: E402
from dsexp.core.result import JobRecord, Phase  # noqa: E402
from dsexp.trims import MODEL_TRIMS  # noqa: E402

TARGET_GIB = 20.6
MODEL = "internlm2_20b_shapes"
SLOWER = 0.05
CHANNELS_1RANK = 64  # NCCL's channel count for a 1-rank communicator on the H200 (NCCL_DEBUG=INFO, TRIMS.md §4.1)
CHANNELS_SETTING = "NCCL_MAX_NCHANNELS"
GIB = m.GIB


def _cfg(r: Dict[str, Any]) -> Dict[str, Any]:
    return r.get("config") or {}


def _plain_autotp(r: Dict[str, Any], tp: int) -> bool:
    c = _cfg(r)
    eng, load = c.get("engine") or {}, c.get("load") or {}
    return (
        (c.get("model") or {}).get("name") == MODEL
        and int(c.get("tp") or 1) == tp
        and eng.get("name") == "init_inference"
        and not eng.get("kernel_inject")
        and load.get("name", "eager") == "eager"
        and c.get("dtype") == (c.get("model") or {}).get("dtype")
        and m.passed(r)
    )


def _trims(r: Dict[str, Any]) -> Dict[str, Any]:
    t = _cfg(r).get("trim") or {}
    return {"model": [k for k in MODEL_TRIMS if t.get(k)], "env": dict(t.get("env") or {})}


def _allocator_extra(r: Dict[str, Any]) -> Optional[int]:
    """Allocator peak (reserved) above the weights: activations, KV cache and the allocator's rounding."""
    parts, w = m.outside_parts(r), m.weights_per_rank(r)
    return None if parts is None or not w else parts["allocator_peak"] - max(w)


def _outside_levels(r: Dict[str, Any]) -> Dict[str, Optional[int]]:
    """NVML process used - torch reserved at the end of start, init and generate (the rank with the highest peak)."""
    parts = m.outside_parts(r) or {}
    rk = next((x for x in JobRecord.of(r).ranks if x.rank == parts.get("rank")), None)
    out = {}
    for ph in (Phase.START, Phase.INIT, Phase.GENERATE):
        g = rk.phase(ph).gpu if rk else {}
        used = g.get("nvml_process_used")
        out[ph.value] = None if used is None else used - (g.get("gpu_reserved") or 0)
    return out


def settings(tp1: List[Dict[str, Any]]) -> Dict[str, Any]:
    """From the tp=1 runs: the baseline, and per setting its saving per part and speed ratio against it."""
    base = next((r for r in tp1 if not _trims(r)["model"] and not _trims(r)["env"]), None)
    if base is None:
        return {"error": "no untrimmed tp=1 baseline among the GPU results"}
    b = m.outside_parts(base)
    if b is None:
        return {"error": "the tp=1 baseline has no per-process NVML figures"}
    bx, bt = _allocator_extra(base), m.headline(base, "tokens_per_s")
    out: Dict[str, Any] = {"baseline": base, "runs": []}
    for r in tp1:
        t = _trims(r)
        if r is base or t["model"] or len(t["env"]) != 1:
            continue
        (key, value), p = next(iter(t["env"].items())), m.outside_parts(r)
        if p is None:
            continue
        saved = {k: (b[k] or 0) - (p[k] or 0) for k in m.OUTSIDE_PARTS}
        saved["allocator_extra"] = (bx or 0) - (_allocator_extra(r) or 0)
        speed = (m.headline(r, "tokens_per_s") or 0) / bt if bt else None
        out["runs"].append(
            {
                "setting": f"{key}={value}",
                "key": key,
                "saved": saved,
                "total_saved": sum(saved.values()),
                "speed": speed,
                "communicator": p.get("communicator"),
                "use": bool(speed is not None and speed >= 1 - SLOWER and sum(saved.values()) > 0),
            }
        )
    out["dedupe"] = next((r for r in tp1 if _trims(r)["model"] == ["dedupe_buffers"] and not _trims(r)["env"]), None)
    out["combined"] = next((r for r in tp1 if _trims(r)["model"] and len(_trims(r)["env"]) > 1), None)
    return out


def tp1_checks(s: Dict[str, Any]) -> Dict[str, Any]:
    """At tp=1: dedupe measured against the memory model, and the settings' savings added up against a run that
    combined them (the prediction at tp=2 adds them the same way)."""
    base, out = s["baseline"], {}
    peak0 = m.headline(base, "gpu_peak_gib")
    if s.get("dedupe") is not None:
        d = s["dedupe"]
        out["dedupe_buffers"] = {
            "weights_saved": max(m.weights_per_rank(base)) - max(m.weights_per_rank(d)),
            "predicted_saved": predict(base).weights_max - predict(d).weights_max,
            "peak_saved_gib": peak0 - m.headline(d, "gpu_peak_gib"),
            "correct": m.passed(d),
        }
    c = s.get("combined")
    if c is not None and "dedupe_buffers" in out:
        env = _trims(c)["env"]
        parts = [x for x in s["runs"] if x["setting"] in {f"{k}={v}" for k, v in env.items()}]
        saved = out["dedupe_buffers"]["weights_saved"] + sum(x["total_saved"] for x in parts)
        out["combined"] = {
            "settings": sorted(f"{k}={v}" for k, v in env.items()),
            "measured_peak_gib": m.headline(c, "gpu_peak_gib"),
            "peak_from_parts_gib": peak0 - saved / GIB,
            "tokens_per_s_ratio": (m.headline(c, "tokens_per_s") or 0) / (m.headline(base, "tokens_per_s") or 1),
        }
    return out


def trimmed_weights(anchor: Dict[str, Any]) -> Dict[str, Any]:
    """The memory model at tp=2 for the anchor's configuration with every model trim on."""
    r = copy.deepcopy(anchor)
    r["config"]["trim"] = {**(r["config"].get("trim") or {}), **{k: True for k in MODEL_TRIMS}}
    r.pop("engine", None)  # the policy from the config, not the untrimmed run's report
    p = predict(r, 2)
    untrimmed = predict(anchor, 2)
    return {"weights": p.weights_max, "untrimmed": untrimmed.weights_max, "kv": max(p.kv_cache)}


def predict_target(tp1: List[Dict[str, Any]], tp2: List[Dict[str, Any]]) -> Dict[str, Any]:
    """The predicted tp=2 NVML peak per GPU of the best trimmed configuration, with every term (bytes)."""
    anchor = next((r for r in tp2 if _plain_autotp(r, 2) and not _trims(r)["model"] and not _trims(r)["env"]), None)
    if anchor is None:
        return {"error": f"no committed untrimmed AutoTP run of {MODEL} at tp=2 to anchor on"}
    w = trimmed_weights(anchor)
    out: Dict[str, Any] = {"weights_tp2_trimmed": w["weights"], "weights_tp2_untrimmed": w["untrimmed"]}
    s = settings([r for r in tp1 if _plain_autotp(r, 1)])
    if "error" in s:
        return {**out, "error": s["error"]}
    a_parts = m.outside_parts(anchor)
    levels, base = _outside_levels(anchor), m.outside_parts(s["baseline"])
    extra2 = _allocator_extra(anchor)
    if a_parts is None or extra2 is None or None in levels.values():
        return {**out, "error": "the tp=2 anchor lacks per-process NVML figures"}
    terms = {
        "weights (memory model, all model trims)": w["weights"],
        "allocator peak above the weights (tp=2 untrimmed, measured)": extra2,
        "outside the allocator at the end of generate (tp=2 untrimmed, measured)": levels["generate"],
        "device reserve (tp=2, measured)": a_parts["device_reserve"],
        "unexplained at tp=2 (peak - allocator peak - outside, measured)": a_parts["unexplained"] or 0,
    }
    own_group = (levels["init"] - levels["start"]) - (base.get("engine") or 0)
    terms["trim.world_group: DeepSpeed's own communicator (tp=2 load+init growth - tp=1's)"] = -max(0, own_group)
    used = [x for x in s["runs"] if x["use"]]
    comm2 = levels["start"] - (base.get("context") or 0)  # the tp=2 world communicator (created at start)
    for x in used:
        saved = dict(x["saved"])
        if x["key"] == CHANNELS_SETTING and base.get("communicator") and x["communicator"] is not None:
            n = int(x["setting"].split("=")[1])
            per = (base["communicator"] - x["communicator"]) / (CHANNELS_1RANK - n)
            fixed = x["communicator"] - n * per
            channels2 = (comm2 - fixed) / per if per > 0 else 0
            saved["communicator"] = max(0.0, (channels2 - n) * per)
            x["tp2_channels_estimate"] = channels2
        terms[f"{x['setting']} (saved at tp=1, per part)"] = -sum(saved.values())
    peak = sum(terms.values())
    speed = 1.0
    for x in used:
        speed *= x["speed"]
    out.update(
        {
            "terms": terms,
            "predicted_peak_gib": peak / GIB,
            "target_gib": TARGET_GIB,
            "meets": peak / GIB <= TARGET_GIB,
            "anchor": {"job": anchor.get("job_dir"), "peak_gib": m.headline(anchor, "gpu_peak_gib")},
            "settings": [{k: v for k, v in x.items() if k != "saved"} for x in s["runs"]],
            "tp1_checks": tp1_checks(s),
            "tokens_per_s": {
                "autotp_tp2_untrimmed": m.headline(anchor, "tokens_per_s"),
                "predicted_trimmed": (m.headline(anchor, "tokens_per_s") or 0) * speed,
                "hf_tp_llama_20b_shapes_tp2": hf_tp_llama(tp2),
            },
        }
    )
    return out


def hf_tp_llama(results: List[Dict[str, Any]]) -> Optional[float]:
    """transformers TP's tokens/s on llama_20b_shapes at tp=2, where a committed run has it."""
    for r in results:
        c = _cfg(r)
        if (c.get("model") or {}).get("name") == "llama_20b_shapes" and (c.get("engine") or {}).get("name") == "hf_tp":
            if int(c.get("tp") or 1) == 2 and m.passed(r):
                return m.headline(r, "tokens_per_s")
    return None


def render(res: Dict[str, Any]) -> str:
    lines = ["# Trims: the tp=2 target, predicted", ""]
    if "weights_tp2_trimmed" in res:
        lines.append(
            f"Weights per GPU at tp=2 (memory model): {m.human(res['weights_tp2_untrimmed'])} untrimmed, "
            f"{m.human(res['weights_tp2_trimmed'])} with every model trim."
        )
    if res.get("error"):
        return "\n".join(lines + ["", f"No prediction of the peak: {res['error']}.", ""])
    lines += ["", "| term | GiB |", "|---|---:|"]
    lines += [f"| {k} | {v / GIB:+.3f} |" for k, v in res["terms"].items()]
    verdict = "meets" if res["meets"] else "misses"
    lines += [
        f"| **predicted NVML peak per GPU** | **{res['predicted_peak_gib']:.2f}** |",
        "",
        f"Target <= {TARGET_GIB} GiB: the prediction {verdict} it (untrimmed tp=2 measured "
        f"{res['anchor']['peak_gib']:.2f} GiB).",
        "",
        "Settings measured at tp=1 (used: correct, saves memory, generate slowed by < 5%):",
        "",
    ]
    for x in res["settings"]:
        ch = f", tp=2 channels ~{x['tp2_channels_estimate']:.0f}" if "tp2_channels_estimate" in x else ""
        lines.append(
            f"- `{x['setting']}`: {m.human(x['total_saved'])} saved at tp=1, tokens/s x{x['speed']:.3f}"
            f"{ch} -> {'used' if x['use'] else 'not used'}"
        )
    checks = res.get("tp1_checks") or {}
    d = checks.get("dedupe_buffers")
    if d:
        lines.append(
            f"- tp=1 `trim.dedupe_buffers`: weights {m.human(d['weights_saved'])} less on the GPU (memory model: "
            f"{m.human(d['predicted_saved'])}), NVML peak {-d['peak_saved_gib']:+.2f} GiB, correct: {d['correct']}"
        )
    c = checks.get("combined")
    if c:
        lines.append(
            f"- tp=1 dedupe + {', '.join(c['settings'])} together: NVML peak {c['measured_peak_gib']:.2f} GiB "
            "measured, "
            f"{c['peak_from_parts_gib']:.2f} GiB from the parts added up (the tp=2 prediction adds them the same way); "
            f"tokens/s x{c['tokens_per_s_ratio']:.3f}"
        )
    t = res["tokens_per_s"]
    hf = t["hf_tp_llama_20b_shapes_tp2"]
    lines += [
        "",
        f"tokens/s: AutoTP tp=2 untrimmed measured {t['autotp_tp2_untrimmed']:.1f}; trimmed predicted "
        f"{t['predicted_trimmed']:.1f} (the settings' tp=1 speed ratios; the embedding's extra all-reduce per forward "
        "is not modelled); transformers TP on llama_20b_shapes at tp=2: "
        + (f"{hf:.1f}" if hf is not None else "not measured in the committed results (needs a tp=2 run)")
        + ".",
        "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trims", type=Path, default=ROOT / "results" / "h200" / "trims")
    ap.add_argument("--tp2", type=Path, default=ROOT / "results" / "h200x2" / "sweeps")
    ap.add_argument("--out", type=Path, help="write the markdown here too (and a .json beside it)")
    args = ap.parse_args(argv)
    tp1 = results_from_dir(args.trims) if args.trims.is_dir() else []
    tp2 = results_from_dir(args.tp2) if args.tp2.is_dir() else []
    if not any(_plain_autotp(r, 1) for r in tp1):
        print(f"no GPU results yet: {args.trims} holds no passed tp=1 run of {MODEL} (python -m dsexp.campaign trims)")
    res = predict_target(tp1, tp2)
    text = render(res)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)
        args.out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
