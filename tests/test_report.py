"""The report on constructed sweeps: recommendation, tables, predictions at tp not run, plots, MLflow round trip."""

from __future__ import annotations

import json
import re

import pytest

from dsexp.analysis.matrix import build_rows, extrapolate, recommend
from dsexp.analysis.memory import predict
from dsexp.analysis.summary import write_report
from dsexp.tracking.readback import _value

from helpers.analysis_cases import GIB, config, result

DIMS8 = dict(
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=8,
    num_key_value_heads=8,
    vocab_size=1024,
    max_position_embeddings=512,
    rope_theta=10000.0,
)


def gpu_sweep():
    """tp=1,2 of an AutoTP config (sharded as predicted), a kernel-injected one (nothing sharded) and an
    incorrect one; GPU runs with a 0.5 GiB start overhead."""
    out, job = [], 0
    for variant, inject, ok in (("autotp", False, True), ("seed", True, True), ("broken", False, False)):
        for tp in (1, 2):
            cfg = config(tp, DIMS8, name="m8", device="cuda", kernel_inject=inject, variant=variant)
            p = predict(result(cfg, [0] * tp), tp)
            w = [p.model_bytes] * tp if inject else p.weights
            peak = max(w) + GIB // 2 + 2**20 * (3 if variant == "broken" else 5)
            out.append(
                result(
                    cfg,
                    w,
                    gpu_start=GIB // 2,
                    gpu_peak=peak,
                    passed=ok,
                    rel_err=5e-3 if ok else 0.2,
                    status="ok" if ok else "failed",
                    job=str(job),
                    failure=None if ok else {"cause": "incorrect_output"},
                    modules={"removed": {}, "added": {}} if inject else p.modules,
                )
            )
            job += 1
    return out


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    results = gpu_sweep()
    write_report(out, results=results, source="constructed")
    return out, results


def test_recommendation_skips_incorrect_and_unsharded(report):
    out, results = report
    rows = build_rows(results)
    best = recommend(rows)["per_device"].row
    assert (best.strategy, best.tp) == ("autotp/m8/eager/init_inference/bf16", 2)  # "broken" is lower but incorrect
    md = (out / "summary.md").read_text()
    assert (
        "**Recommended (lowest per-GPU peak that passed correctness): `autotp/m8/eager/init_inference/bf16` at "
        "tp=2**" in md
    )


def test_every_run_has_a_diagnosis_and_tables_are_well_formed(report):
    out, results = report
    md = (out / "summary.md").read_text()
    sections = re.findall(r"### `([^`]+)`\n\n((?:- .*\n)+)", md)
    assert len(sections) == len(results)
    assert (
        "nothing was sharded (no module was replaced)"
        in dict(sections)["seed/m8/eager/init_inference+inject/bf16 tp=2"]
    )
    for block in re.findall(r"((?:^\|.*\|\n)+)", md, flags=re.M):
        widths = {len(re.split(r"(?<!\\)\|", line)) for line in block.strip().splitlines()}
        assert len(widths) == 1, block  # every row has as many cells as the header
    csv = (out / "summary.csv").read_text().splitlines()
    assert csv[0].startswith("config,tp,status,correct,logits_rel_err,gpu_peak_gib,gpu_weights_gib,pred_weights_gib")
    assert len(csv) == 1 + len(results)


def test_predictions_at_tp_4_and_8_come_from_the_model(report):
    out, results = report
    rows = build_rows(results)
    extra = {(e.strategy, e.tp): e for e in extrapolate(rows)}
    base = next(r for r in rows if r.strategy.startswith("autotp") and r.tp == 2)
    for tp in (4, 8):
        e, p = extra[(base.strategy, tp)], predict(base.result, tp)
        assert not e.measured and e.weights_gib == pytest.approx(p.weights_max / GIB)
        # calibrated: the measured peak at tp=2 minus its floor, plus the floor at this tp
        assert e.per_device_gib == pytest.approx(
            base.values()["gpu_peak_gib"] + (p.floor() - base.prediction.floor()) / GIB
        )
    assert extra[(base.strategy, 8)].per_device_gib < extra[(base.strategy, 4)].per_device_gib
    md = (out / "summary.md").read_text()
    assert "| autotp/m8/eager/init_inference/bf16 | 8 | model at tp=8 anchored on tp=2: weights as modelled; " in md


def test_plots_are_pngs_with_the_floor_drawn(report):
    out, results = report
    memory = [f"memory_{i:02d}.png" for i in range(len(results))]  # every run's phases (no series here: no curves)
    for name in ("per_device_vs_tp.png", "host_vs_tp.png", *memory):
        data = (out / "plots" / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    md = (out / "summary.md").read_text()
    assert "![per_device](plots/per_device_vs_tp.png)" in md and "timeline.png" not in md
    section = md.split("## Memory over time")[1].split("\n## ")[0]
    assert re.findall(r"\(plots/(memory_\d+\.png)\)", section) == memory
    assert section.count("(failed: incorrect_output)") == 2 and "ui.perfetto.dev" in section


def test_params_read_back_from_mlflow_strings():
    assert [_value(v) for v in ("2", "2.5", "True", "None", "bf16", "{'A': ['x', 'y']}", "[]")] == [
        2,
        2.5,
        True,
        None,
        "bf16",
        {"A": ["x", "y"]},
        [],
    ]


def test_report_from_mlflow_parent_run(tmp_path):
    """Runs logged as a sweep (one with result.json, one from params/metrics only) -> CLI -> report on the parent."""
    from mlflow.tracking import MlflowClient

    from dsexp.report import main
    from dsexp.tracking.runs import Tracker, flatten, job_metrics, run_name

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = Tracker(uri, "exp")
    parent = tracker.start_parent("sweep s", {})
    results = gpu_sweep()[:2]
    for i, res in enumerate(results):
        job = tmp_path / f"job{i}"
        job.mkdir()
        if i == 0:
            (job / "result.json").write_text(json.dumps(res))
            tracker.log_job(res, job, parent, run_name(res["config"]))
        else:  # no artifacts: rebuilt from params and metrics
            rid = tracker.client.create_run(
                tracker.experiment_id,
                run_name=run_name(res["config"]),
                tags={"dsexp.kind": "job", "mlflow.parentRunId": parent, "dsexp.status": "ok"},
            ).info.run_id
            tracker.log_params(rid, flatten(res["config"]))
            tracker.log_metrics(rid, job_metrics(res))
    assert main(["--parent-run", parent, "--tracking-uri", uri, "--out", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "summary.md").read_text()
    assert "autotp/m8/eager/init_inference/bf16 tp=1" in md and "autotp/m8/eager/init_inference/bf16 tp=2" in md
    client = MlflowClient(uri)
    arts = {a.path for a in client.list_artifacts(parent, "report")}
    assert {"report/summary.md", "report/summary.csv", "report/plots"} <= arts
    assert client.get_run(parent).data.tags["dsexp.recommendation"].startswith("autotp/m8")
    exp = client.get_experiment_by_name("exp")
    assert f"mlflow.sharedViewState.dsexp-{parent}" in exp.tags
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"  # the UI's classic runs view
    assert f"viewStateShareKey=dsexp-{parent}&workflowType=machine_learning" in md  # the link opens that view
    runs = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent}'")
    assert len(runs) == 2 and all("dsexp.diagnosis" in r.data.tags for r in runs)
    assert any("pred.weights_gib" in r.data.metrics for r in runs)


def test_cli_prints_one_section_for_docs(tmp_path, capsys):
    from dsexp.report import main

    for i, res in enumerate(gpu_sweep()):
        (tmp_path / str(i)).mkdir()
        (tmp_path / str(i) / "result.json").write_text(json.dumps(res))
    assert main([str(tmp_path), "--no-mlflow", "--print", "matrix"]) == 0
    printed = capsys.readouterr().out  # (in a fresh process library logs go to stderr; here pytest holds them)
    section = printed[printed.index("## Matrix") :].strip()
    assert section.startswith("## Matrix\n\n| configuration | tp |")
    assert section.count("\n| ") == 1 + 6  # header + six runs
    assert section in (tmp_path / "summary.md").read_text()


def _medium_gpu(tp, job, **kw):
    from helpers.analysis_cases import MEDIUM

    cfg = config(
        tp,
        MEDIUM,
        name="medium",
        device="cuda",
        **{k: v for k, v in kw.items() if k in ("load", "engine", "zero", "stage", "offload", "variant")},
    )
    p = predict(result(cfg, [0] * tp), tp)
    return result(
        cfg,
        kw.get("weights", p.weights),
        gpu_start=GIB,
        gpu_peak=max(kw.get("weights", p.weights)) + 2 * GIB,
        job=job,
        anon_growth=kw.get("anon", 200 * 2**20),
        node=(3 * GIB, 3 * GIB + tp * GIB),
    ), p


def test_predictions_at_larger_tp_follow_the_model_and_never_go_negative():
    sharded, p2 = _medium_gpu(2, "0", load="sharded", variant="sharded")
    low, _ = _medium_gpu(2, "1", variant="low", weights=[int(w * 0.6) for w in p2.weights])  # far below the model
    rows = build_rows([sharded, low])
    extra = {(e.strategy.split("/")[0], e.tp): e for e in extrapolate(rows)}
    host2 = sharded["headline"]["host_peak_gib"]
    for tp in (4, 8):
        e, p = extra[("sharded", tp)], predict(sharded, tp)
        assert e.weights_gib == pytest.approx(p.weights_max / GIB)
        assert e.host_peak_gib == pytest.approx(host2)  # one (replicated) tensor mapped at a time, at any tp
        assert e.node_host_peak_gib == pytest.approx(3 + tp * 1.0)  # before launch + ranks x private per rank
        lo = extra[("low", tp)]
        assert lo.weights_gib * GIB >= p.unshardable > 0 and lo.per_device_gib > lo.weights_gib
        assert "measured/predicted at tp=2" in lo.note


def test_recommendation_states_offload_costs_ties_and_floor():
    off, _ = _medium_gpu(
        2, "0", engine="zero_inference", zero="stage3", stage=3, offload="cpu", variant="offload", anon=3 * GIB
    )
    a, _ = _medium_gpu(2, "1", variant="a", anon=2 * GIB)
    b, _ = _medium_gpu(2, "2", variant="b", load="sharded", anon=100 * 2**20)
    b["headline"]["gpu_peak_gib"] *= 1.005  # within 1% of a: tied, b has the lower host peak
    rows = build_rows([off, a, b])
    picks = recommend(rows)
    assert picks["per_device"].row.strategy.startswith("offload")
    plain = picks["per_device_no_offload"]
    assert plain.row.strategy.startswith("b/") and [r.strategy[0] for r in plain.tied] == ["b", "a"]
    from dsexp.analysis.sections.recommendation import recommendation_lines

    text = "\n".join(recommendation_lines(rows, []))
    assert (
        text.index("**Recommended (lowest per-GPU peak without offloading weights to the host")
        < text.index("`b/")
        < text.index("Lowest per-GPU peak of all (weights offloaded to host memory): `offload/")
    )
    assert "What the offload costs against the recommended configuration: host peak" in text
    assert "2 runs tie within 1%; the lowest host peak per rank wins" in text
    assert re.search(
        r"`b/\S+ tp=2`: per-GPU peak \d+\.\d\d GiB vs the memory model's floor \d+\.\d\d GiB .*over the "
        r"floor, (within|beyond) 5%",
        text,
    )
