"""Any model as its authors published it: the CPU architecture matrix through model=config (tiny shapes, random
weights, tp=2). Every architecture runs DeepSpeed AutoTP with engine.injection_policy=infer, plus transformers TP
where its config has a TP plan. Each run is correct, or fails with a diagnosis naming the module it failed in (or
the policy to pass); the memory model is within 2% of the measured weights on every rank wherever the placement
was recorded (every run that got through init), and equal tensor by tensor.

Fast: the matrix's census, recorded by the slow test in tests/data/arch_matrix_census.json, against the memory
model (no launch), and one real run of the InternLM2 layout with no policy given (infer) beside phi3 (fused qkv
and gate-up, which fails in generate). Slow: the whole matrix, which writes the table in docs/user-guide.md and
checks its census against the committed one, which it never rewrites (a census changed on purpose is committed by
hand from the copy it leaves).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Dict, List

import pytest
import yaml

from dsexp.analysis import measured as m
from dsexp.analysis.diagnosis import diagnose, tensor_differences
from dsexp.analysis.labels import config_label
from dsexp.analysis.memory import predict

from helpers.run import CONF, ROOT, run_dsexp, sweep_results
from helpers.tables import publish

PRESETS = sorted(p.stem for p in (CONF / "model").glob("tiny_*.yaml"))
CENSUS = Path(__file__).parent / "data" / "arch_matrix_census.json"
TABLE = ROOT / "results" / "cpu" / "arch_matrix.md"
TOL = 0.02


def preset(name: str) -> Dict[str, Any]:
    text = (CONF / "model" / f"{name}.yaml").read_text()
    features = re.search(r"^# [^:]+: (.*?)\. Tiny shapes", text, re.M)
    return {**yaml.safe_load(text), "features": features.group(1) if features else ""}


def has_tp_plan(name: str) -> bool:
    from dsexp.models.presets import config_summary, make_config

    mdl = preset(name)
    return config_summary(make_config(mdl["arch"], mdl["dims"], "bf16"))["tp_plan"]


# --- checks shared by the fast and the slow test -------------------------------------------------------------


def weights_error(res: Dict[str, Any]) -> float:
    """Largest relative error of the predicted weights per rank against the census."""
    p, w = predict(res), m.weights_per_rank(res)
    assert len(w) == p.tp, f"{config_label(res['config'])}: no census for every rank"
    return max(abs(got - want) / want for got, want in zip(w, p.weights))


def check_run(res: Dict[str, Any]) -> None:
    label = config_label(res["config"])
    p = predict(res)
    text = " ".join(f.text for f in diagnose(res, p))
    if m.init_recorded(res):  # the placement is whole: as predicted, tensor by tensor
        assert weights_error(res) <= TOL, (label, m.weights_per_rank(res), p.weights)
        assert tensor_differences(res, p) == [], (label, tensor_differences(res, p))
        assert res["engine"]["modules"]["added"] == p.modules["added"], label
    if res["status"] == "ok":
        assert res["correctness"]["passed"], (label, res["correctness"])
        return
    fail = res["failure"]
    site = (fail.get("site") or {}).get("module")
    if site:  # the module it failed in is named
        assert f"raised in module {site}" in text, (label, text)
    else:  # or, where DeepSpeed found no policy, the policy to pass
        assert "engine.injection_policy=" in text, (label, fail["message"], text)


# --- the table -------------------------------------------------------------------------------------------------


def _human(b: float) -> str:
    return f"{b / 1024:.0f}K"


def cell_autotp(res: Dict[str, Any]) -> List[str]:
    p = predict(res)
    inf = (res.get("engine") or {}).get("policy_inference") or p.policy or {}
    pol = "; ".join(f"{c}: {', '.join(n)}" for c, n in sorted((inf.get("policy") or {}).items()))
    policy = f"{inf.get('source')}: {pol}" if pol else "-"
    if res["status"] == "ok":
        outcome = f"ok, rel. err {res['correctness']['logits_rel_err']:.4f}"
    else:
        f = res["failure"]
        site = f.get("site") or {}
        where = f" in `{site['module']}` ({site['class']} in {site.get('parent_class')})" if site else ""
        outcome = f"**fails** in {f['phase']}{where}: {f['message'][:90]}"
    mods = (res.get("engine") or {}).get("modules", {}).get("added") or {}
    replaced = ", ".join(f"{k} x{v}" for k, v in sorted(mods.items())) or "-"
    if not m.init_recorded(res):  # no placement to compare: the engine failed while placing the model
        return [policy, outcome, replaced, "- (failed before the census)", "-"]
    w = m.weights_per_rank(res)
    weights = (
        f"{_human(max(w))} of {_human(p.model_bytes)} ({max(w) / p.model_bytes:.0%}); predicted "
        f"{_human(p.weights_max)}, {weights_error(res):+.2%}"
    )
    rep = [re.sub(r"^(model|transformer|gpt_neox)\.(decoder\.)?", "", n) for n in p.replicated()]
    rep = [n for n in rep if not re.search(r"norm|ln_|rotary|inv_freq|\.bias$", n)]
    copies = [pl for pl in p.placements if pl.copy]
    whole = ", ".join(rep[:5]) + (f"; tied head cloned ({_human(max(copies[0].local))}/rank)" if copies else "")
    return [policy, outcome, replaced, weights, whole or "-"]


def cell_hf(res: Dict[str, Any]) -> str:
    if res is None:
        return "no TP plan"
    if res["status"] != "ok":
        return f"**fails**: {res['failure']['message'][:80]}"
    p, w = predict(res), m.weights_per_rank(res)
    return (
        f"ok, rel. err {res['correctness']['logits_rel_err']:.4f}; {_human(max(w))} ({max(w) / p.model_bytes:.0%}); "
        f"predicted {weights_error(res):+.2%}"
    )


def write_table(autotp: Dict[str, dict], hf: Dict[str, dict]) -> str:
    head = [
        "architecture (`model=`)",
        "features",
        "AutoTP policy (`infer`: source)",
        "AutoTP tp=2",
        "modules AutoTP added",
        "weights per rank (AutoTP), of the model; memory model",
        "whole on every rank besides norms, biases, RoPE (AutoTP)",
        "transformers TP tp=2",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in PRESETS:
        row = [f"`{name}` ({preset(name)['arch']})", preset(name)["features"]]
        row += cell_autotp(autotp[name]) + [cell_hf(hf.get(name))]
        lines.append("| " + " | ".join(c.replace("|", "/").replace("\n", " ") for c in row) + " |")
    errs = [weights_error(r) for r in [*autotp.values(), *hf.values()] if m.init_recorded(r)]
    table = "\n".join(lines) + f"\n\nMemory model vs census: worst {max(errs):.2%} over {len(errs)} runs.\n"
    return publish(
        table,
        TABLE,
        "tests/test_arch_matrix.py::test_architecture_matrix",
        "arch-matrix",
        ROOT / "docs" / "user-guide.md",
    )


def census_record(res: Dict[str, Any]) -> Dict[str, Any]:
    """What the memory model needs to be checked against a run without it: config, engine report, census."""
    eng = res.get("engine") or {}
    return {
        "config": res["config"],
        "status": res["status"],
        "runtime": {"device": (res.get("runtime") or {}).get("device")},
        "engine": {k: eng[k] for k in ("injection_policy", "policy_inference", "modules") if k in eng},
        "ranks": [
            {
                "rank": rk["rank"],
                "phases": {"init": {k: rk["phases"]["init"].get(k) for k in ("weights_device", "tensors", "partial")}},
                "error": {"phase": (rk.get("error") or {}).get("phase")} if rk.get("error") else None,
            }
            for rk in (r for r in res.get("ranks") or [] if r)
            if "init" in (rk.get("phases") or {})
        ],
    }


# --- tests -----------------------------------------------------------------------------------------------------


def test_matrix_census_against_the_memory_model():
    """The census of every matrix run that got through init, replayed against the memory model (no launch)."""
    records = json.loads(CENSUS.read_text())
    assert len({r["config"]["model"]["name"] for r in records}) >= 10
    for rec in records:
        assert weights_error(rec) <= TOL, config_label(rec["config"])
        assert tensor_differences(rec, predict(rec)) == [], config_label(rec["config"])
        assert rec["engine"]["modules"]["added"] == predict(rec).modules["added"], config_label(rec["config"])


@pytest.mark.slow  # minutes on 2 cores: make test-all
def test_internlm2_layout_with_no_policy_gets_one_and_a_fused_projection_failure_names_its_module(tmp_path, cache_dir):
    run_dsexp(
        [
            "-m",
            "experiment=autotp",
            "model=internlm2_tiny,tiny_phi3",
            "engine.injection_policy=infer",
            "tp=2",
            "hydra.sweep.dir=multirun/s",
        ],
        tmp_path,
        cache_dir,
    )
    ilm2, phi3 = sweep_results(tmp_path / "multirun" / "s")
    assert ilm2["config"]["model"]["name"] == "internlm2_tiny" and ilm2["status"] == "ok"
    inf = ilm2["engine"]["policy_inference"]
    assert inf["policy"] == {"InternLM2DecoderLayer": ["attention.wo", "feed_forward.w2"]}
    assert inf["source"] == "known" and inf["rule"] == inf["policy"] and inf["agrees"]
    assert ilm2["engine"]["injection_policy"] == inf["policy"] and ilm2["correctness"]["passed"]
    assert ilm2["engine"]["modules"]["added"] == {"LinearLayer": 6, "LinearAllreduce": 4}
    assert phi3["status"] == "failed" and phi3["failure"]["phase"] == "generate"
    assert phi3["failure"]["site"]["module"] == "model.layers.0.self_attn.o_proj"
    assert phi3["engine"]["modules"]["added"]["fused_LinearLayer"] == 2  # kept from init
    for res in (ilm2, phi3):
        check_run(res)
    summary = (tmp_path / "multirun" / "s" / "summary.md").read_text()
    assert "AutoTP policy (known) InternLM2DecoderLayer: attention.wo, feed_forward.w2" in summary
    assert "raised in module model.layers.0.self_attn.o_proj (LinearAllreduce inside Phi3Attention" in summary


@pytest.mark.slow
@pytest.mark.timeout(3600)
def test_architecture_matrix(tmp_path, cache_dir):
    hf_presets = [p for p in PRESETS if has_tp_plan(p)]
    common = ["tp=2", "check.correctness=true"]
    infer = "engine.injection_policy=infer"
    run_dsexp(
        ["-m", "model=" + ",".join(PRESETS), infer, *common, "hydra.sweep.dir=multirun/a"],
        tmp_path,
        cache_dir,
        timeout=3000,
    )
    run_dsexp(
        ["-m", "model=" + ",".join(hf_presets), "engine=hf_tp", *common, "hydra.sweep.dir=multirun/h"],
        tmp_path,
        cache_dir,
        timeout=3000,
    )
    autotp = {r["config"]["model"]["name"]: r for r in sweep_results(tmp_path / "multirun" / "a")}
    hf = {r["config"]["model"]["name"]: r for r in sweep_results(tmp_path / "multirun" / "h")}
    assert sorted(autotp) == PRESETS and sorted(hf) == sorted(hf_presets) and len(PRESETS) >= 10
    for res in [*autotp.values(), *hf.values()]:
        check_run(res)
    assert all(r["status"] == "ok" for r in hf.values())
    assert sum(r["status"] == "ok" for r in autotp.values()) >= 8
    records = [census_record(r) for r in [*autotp.values(), *hf.values()] if m.init_recorded(r)]
    assert_census_is_the_committed_one(records, tmp_path)
    table = write_table(autotp, hf)
    assert table.count("\n| `tiny_") == len(PRESETS)


def assert_census_is_the_committed_one(records: List[Dict[str, Any]], tmp_path: Path) -> None:
    """The matrix's census against tests/data/arch_matrix_census.json, which the fast tests read: the same models,
    and on each rank the same tensors and device bytes at init. This test never rewrites it; a census changed on
    purpose is written beside the run for a person to commit."""
    fresh = tmp_path / CENSUS.name
    fresh.write_text(json.dumps(records, indent=None, sort_keys=True) + "\n")

    def placed(recs):
        return {
            (config_label(r["config"]), rk["rank"]): {k: rk["phases"]["init"][k] for k in ("weights_device", "tensors")}
            for r in recs
            for rk in r["ranks"]
        }

    committed = json.loads(CENSUS.read_text())
    assert placed(records) == placed(committed), f"the census changed: if meant, cp {fresh} {CENSUS}"


def test_where_census_and_prediction_differ_the_diagnosis_lists_the_tensors():
    """A mixtral run whose experts were (hypothetically) split: the finding names them, predicted -> measured."""
    import copy

    rec = next(r for r in json.loads(CENSUS.read_text()) if r["config"]["model"]["name"] == "tiny_mixtral")
    rec = copy.deepcopy(rec)
    for rk in rec["ranks"]:
        init = rk["phases"]["init"]
        for name in [n for n in init["tensors"] if ".mlp.experts." in n]:
            init["weights_device"] -= init["tensors"][name] // 2
            init["tensors"][name] //= 2
    p = predict(rec)
    rows = tensor_differences(rec, p)
    assert {r[0] for r in rows} == {"model.layers.*.mlp.experts.gate_up_proj", "model.layers.*.mlp.experts.down_proj"}
    text = " ".join(f.text for f in diagnose(rec, p))
    assert "weights on each rank" in text and "tensors (predicted -> measured per rank)" in text
    assert "model.layers.*.mlp.experts.gate_up_proj (x2) on rank 0 1.00 MiB -> 512.0 KiB" in text
