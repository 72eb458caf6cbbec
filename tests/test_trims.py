"""The trims (`trim=` group): config and validation, the memory model's predictions, the outside-allocator
attribution, the report, the tp=2 target script, and real CPU runs whose per-rank weights must equal the prediction
exactly with outputs matching tp=1. The slow test runs every trim alone and all together at tp=2 and tp=4 on
internlm2_tiny and on the Llama-layout tiny model and writes results/cpu/trims.md."""

from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from dsexp.analysis import measured as m
from dsexp.analysis.diagnosis import diagnose
from dsexp.analysis.labels import config_label
from dsexp.analysis.matrix import build_rows
from dsexp.analysis.memory import predict
from dsexp.analysis.sections.trim_effects import trim_effects, trim_lines, trims_table
from dsexp.core.schema import ConfigError
from dsexp.job.launch import rank_env
from dsexp.trims import label
from dsexp.trims.dedupe_buffers import identical

from helpers.analysis_cases import GIB, INTERNLM2_TINY, MIB, config, result
from helpers.run import ROOT, run_dsexp, spec_of, sweep_results

TRIMS = ("dedupe_buffers", "shard_head", "shard_embedding", "world_group")
POLICY = {"InternLM2DecoderLayer": ["attention.wo", "feed_forward.w2"]}


# --- config ----------------------------------------------------------------------------------------------------


def test_trim_group_defaults_off_and_all_turns_every_model_trim_on():
    assert not any(getattr(spec_of().trim, k) for k in TRIMS) and spec_of().trim.env == {}
    t = spec_of("model=internlm2_tiny", "trim=all").trim
    assert all(getattr(t, k) for k in TRIMS) and t.env == {}
    t = spec_of("trim.shard_head=true", "+trim.env.NCCL_MAX_NCHANNELS=8", "+trim.env.CUDA_MODULE_LOADING=LAZY").trim
    assert t.shard_head and not t.dedupe_buffers and t.env == {"NCCL_MAX_NCHANNELS": "8", "CUDA_MODULE_LOADING": "LAZY"}


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["engine=hf_tp", "trim.shard_head=true"], "trim.shard_head=true changes DeepSpeed's AutoTP call"),
        (["engine=zero_inference", "zero=stage3", "trim.world_group=true"], "needs engine=init_inference"),
        (["model=internlm2_tiny", "engine.kernel_inject=true", "trim.shard_embedding=true"], "needs AutoTP"),
        (["+trim.env.LD_PRELOAD=/x.so"], "trim.env.LD_PRELOAD is not a setting dsexp passes to the ranks"),
        (["+trim.env.NCCL_NVLS_ENABLE=1"], "trim.env.NCCL_NVLS_ENABLE: dsexp sets it to 0"),
    ],
)
def test_validation_refuses_a_trim_where_it_cannot_apply(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        spec_of(*overrides)


def test_dedupe_applies_to_every_engine():
    for eng in ("engine=hf_tp", "engine=zero_inference"):
        assert spec_of(eng, "zero=stage3", "trim.dedupe_buffers=true").trim.dedupe_buffers


def test_trim_env_reaches_the_rank_environment_last():
    env = rank_env(spec_of("+trim.env.NCCL_MAX_NCHANNELS=8", "+trim.env.PYTORCH_CUDA_ALLOC_CONF=x"), "cuda")
    assert env["NCCL_MAX_NCHANNELS"] == "8" and env["PYTORCH_CUDA_ALLOC_CONF"] == "x"
    assert env["NCCL_NVLS_ENABLE"] == "0"


def test_label_and_identical_rule():
    assert (
        label({"shard_head": True, "dedupe_buffers": True, "env": {"B": 2, "A": "x"}})
        == "trim(dedupe,head)+env(A=x,B=2)"
    )
    assert label({}) is None and label(None) is None
    cfg = config(2)
    assert config_label(cfg) == config_label(dict(cfg, trim={"env": {}}))  # untrimmed: the label is unchanged
    items = [("a", 1, 10), ("b", 1, 10), ("c", 2, 10), ("d", 1, 11), ("e", 1, 11)]
    assert identical(items, lambda x, y: x == y) == {"b": "a", "e": "d"}  # same key and value: the first one


# --- memory model ------------------------------------------------------------------------------------------------


def internlm2(tp, trim=None, device="cpu", **kw):
    cfg = config(tp, INTERNLM2_TINY, name="internlm2_tiny", device=device, **kw)
    cfg["model"].update(arch="internlm2", trust_remote_code=True, injection_policy=POLICY)
    cfg["trim"] = {**{k: False for k in TRIMS}, "env": {}, **(trim or {})}
    return cfg


@pytest.mark.parametrize("tp", [2, 4])
def test_memory_model_each_trim_from_the_architecture_numbers(tp):
    d = INTERNLM2_TINY
    h, V, L, P = d["hidden_size"], d["vocab_size"], d["num_hidden_layers"], d["max_position_embeddings"]
    hd = h // d["num_attention_heads"]
    base = predict(result(internlm2(tp), [0] * tp), tp)
    table = V * h * 2  # bf16 head / embedding
    per_layer_buffers = 2 * P * hd * 2 + hd // 2 * 4  # cos + sin (bf16), inv_freq (fp32, restored)

    def weights(**trim):
        return predict(result(internlm2(tp, trim), [0] * tp), tp).weights

    assert weights(shard_head=True) == [w - table + table // tp for w in base.weights]
    assert weights(shard_embedding=True) == [w - table + table // tp for w in base.weights]
    assert weights(dedupe_buffers=True) == [w - (L - 1) * per_layer_buffers for w in base.weights]
    assert weights(world_group=True) == base.weights
    every = predict(result(internlm2(tp, {k: True for k in TRIMS}), [0] * tp), tp)
    assert every.weights == [w - 2 * (table - table // tp) - (L - 1) * per_layer_buffers for w in base.weights]
    added = every.modules["added"]
    assert added["LmHeadLinearAllreduce"] == 1 and added["VocabParallelEmbedding"] == 1
    assert every.modules["removed"]["Embedding"] == 1
    assert "output.weight" not in every.replicated() and "model.tok_embeddings.weight" not in every.replicated()
    assert every.model_bytes == base.model_bytes  # the same model, fewer bytes on each rank


def test_memory_model_llama_head_is_already_split_and_nothing_to_dedupe():
    base = predict(result(config(2), [0, 0]), 2)
    cfg = dict(config(2), trim={"shard_head": True, "dedupe_buffers": True})
    assert predict(result(cfg, [0, 0]), 2).weights == base.weights  # lm_head: AutoTP's; one model-level rotary
    emb = dict(config(2), trim={"shard_embedding": True})
    assert predict(result(emb, [0, 0]), 2).weights == [w - 1024 * 256 for w in base.weights]


# --- outside the allocator, diagnosis, report --------------------------------------------------------------------


def gpu_run(tp, trim=None, weights=None, outside=(520, 560, 390, 160), reserve=600, extra=300, speed=10.0, job="0"):
    """A GPU result with the start readings and phase snapshots of a rank (MiB): context, communicator, load+init,
    generate growth outside the allocator; `extra` MiB of allocator peak above the weights."""
    cfg = internlm2(tp, trim, device="cuda")
    w = weights or predict(result(cfg, [0] * tp), tp).weights
    ctx, comm, eng, gen = (x * MIB for x in outside)
    res = result(cfg, w, gpu_start=reserve * MIB, gpu_peak=0, job=job)
    for rk, wr in zip(res["ranks"], w):
        reserved = wr + extra * MIB
        levels = {"start": ctx + comm, "load": ctx + comm, "init": ctx + comm + eng, "generate": ctx + comm + eng + gen}
        for ph, lvl in levels.items():
            r = 0 if ph in ("start", "load") else reserved
            proc = r + lvl
            rk["phases"][ph]["gpu"] = {
                "nvml_process_used": proc,
                "nvml_device_used": proc + reserve * MIB,
                "gpu_reserved": r,
                "gpu_reserved_peak": r,
            }
            rk["phases"][ph]["peaks"]["nvml_device_used_peak"] = proc + reserve * MIB
        rk["phases"]["start"]["outside"] = {
            "context": {"nvml_process_used": ctx, "gpu_reserved": 0},
            "communicator": {"nvml_process_used": ctx + comm + 2 * MIB, "gpu_reserved": 2 * MIB},
        }
    res["metrics"] = m_records().aggregate_metrics(res["ranks"])
    res["headline"] = m_records().headline(res["metrics"], res["ranks"], 16)
    res["headline"]["tokens_per_s"] = speed
    res["engine"]["modules"] = predict(res).modules
    return res


def m_records():
    from dsexp.core import records

    return records


def test_outside_parts_add_up_to_the_peak():
    res = gpu_run(2)
    parts = m.outside_parts(res)
    assert [parts[k] // MIB for k in ("context", "communicator", "engine", "generate", "device_reserve")] == [
        520,
        560,
        390,
        160,
        600,
    ]
    assert parts["unexplained"] == 0 and parts["nvml_peak"] == parts["allocator_peak"] + parts["outside"]
    by = {f.code: f for f in diagnose(res, predict(res), [])}
    assert "CUDA context 520.00 MiB" in by["outside_allocator"].text and "unexplained" in by["outside_allocator"].text
    assert by["own_communicator"].severity == "problem" and "trim.world_group=true" in by["own_communicator"].text
    world = gpu_run(2, {"world_group": True}, outside=(520, 560, 20, 160))
    codes = {f.code for f in diagnose(world, predict(world), [])}
    assert "own_communicator" not in codes and "outside_allocator" in codes


def test_outside_parts_absent_on_cpu_and_old_records_do_not_fail():
    assert m.outside_parts(result(config(2), [1, 1])) is None
    old = gpu_run(2)
    for rk in old["ranks"]:
        del rk["phases"]["start"]["outside"]
    parts = m.outside_parts(old)
    assert parts["context"] == (520 + 560) * MIB and parts["communicator"] is None  # start snapshot: both together


def test_report_compares_each_trim_with_its_untrimmed_run_and_judges_settings_by_speed():
    results = [
        gpu_run(2, job="0", speed=10.0),
        gpu_run(2, {"dedupe_buffers": True, "shard_head": True}, job="1", speed=9.9),
        gpu_run(2, {"env": {"NCCL_MAX_NCHANNELS": "8"}}, outside=(520, 300, 390, 160), job="2", speed=9.8),
        gpu_run(2, {"env": {"CUBLAS_WORKSPACE_CONFIG": ":0:0"}}, outside=(520, 560, 390, 60), job="3", speed=9.0),
    ]
    rows = build_rows(results)
    effects = {e.row.values()["trims"]: e for e in trim_effects(rows)}
    head = effects["trim(dedupe,head)"]
    assert head.base is not None and head.weights > 0 and head.verdict() == "correct, saves memory"
    assert effects["env(NCCL_MAX_NCHANNELS=8)"].verdict() == "recommended"
    assert effects["env(NCCL_MAX_NCHANNELS=8)"].outside == pytest.approx(260 / 1024)
    assert effects["env(CUBLAS_WORKSPACE_CONFIG=:0:0)"].verdict() == "not recommended: generate 10% slower"
    table = trims_table(rows)
    assert "| exact |" in table and "trim(dedupe,head)" in table
    lines = " ".join(trim_lines(rows))
    assert "`env(NCCL_MAX_NCHANNELS=8)` at tp=2" in lines and "not recommended" in lines
    row = next(r for r in rows if r.values()["trims"] == "env(NCCL_MAX_NCHANNELS=8)").values()
    assert row["outside_communicator_gib"] == pytest.approx(300 / 1024) and row["outside_unexplained_gib"] == 0


# --- the tp=2 target script ----------------------------------------------------------------------------------------


def _target():
    spec = importlib.util.spec_from_file_location("trims_target", ROOT / "benchmarks" / "trims_target.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_target_script_without_gpu_results_says_so(tmp_path, capsys):
    assert _target().main(["--trims", str(tmp_path / "none"), "--tp2", str(tmp_path / "none")]) == 0
    out = capsys.readouterr().out
    assert "no GPU results yet" in out and "No prediction of the peak" in out


def test_target_script_on_synthetic_results_adds_up_its_terms(tmp_path):
    t = _target()

    def named(res, tp):
        res["config"]["model"]["name"] = t.MODEL
        res["config"]["tp"] = tp
        return res

    anchor = named(gpu_run(2, outside=(520, 450, 660, 350), job="a"), 2)
    tp1 = [
        named(gpu_run(1, outside=(520, 650, 0, 160), job="b"), 1),
        named(gpu_run(1, {"env": {"NCCL_MAX_NCHANNELS": "8"}}, outside=(520, 314, 0, 160), job="c"), 1),
        named(gpu_run(1, {"env": {"CUDA_MODULE_LOADING": "EAGER"}}, outside=(1250, 650, 0, 160), job="d"), 1),
        named(gpu_run(1, {"dedupe_buffers": True}, outside=(520, 650, 0, 160), job="e"), 1),
        named(
            gpu_run(
                1, {"dedupe_buffers": True, "env": {"NCCL_MAX_NCHANNELS": "8", "A": "1"}}, outside=(520, 314, 0, 160)
            ),
            1,
        ),
    ]
    for job, res in zip("abcdef", [anchor, *tp1]):
        (tmp_path / job).mkdir()
        (tmp_path / job / "result.json").write_text(json.dumps(res))
    got = t.predict_target(tp1, [anchor])
    terms = got["terms"]
    assert sum(terms.values()) / GIB == pytest.approx(got["predicted_peak_gib"])
    assert terms["trim.world_group: DeepSpeed's own communicator (tp=2 load+init growth - tp=1's)"] == -660 * MIB
    nccl = next(x for x in got["settings"] if x["key"] == "NCCL_MAX_NCHANNELS")
    assert nccl["use"] and nccl["tp2_channels_estimate"] == pytest.approx((970 - 520 - 266) / 6 + 0, rel=0.05)
    eager = next(x for x in got["settings"] if x["key"] == "CUDA_MODULE_LOADING")
    assert not eager["use"]  # costs memory
    checks = got["tp1_checks"]
    assert checks["dedupe_buffers"]["weights_saved"] == checks["dedupe_buffers"]["predicted_saved"] > 0
    assert checks["combined"]["peak_from_parts_gib"] == pytest.approx(checks["combined"]["measured_peak_gib"])
    untrimmed_peak = m.headline(anchor, "gpu_peak_gib")
    assert got["predicted_peak_gib"] < untrimmed_peak
    assert t.main(["--trims", str(tmp_path), "--tp2", str(tmp_path), "--out", str(tmp_path / "t.md")]) == 0
    assert "predicted NVML peak per GPU" in (tmp_path / "t.md").read_text()


# --- real CPU runs -------------------------------------------------------------------------------------------------


def check_run(res):
    """Ok, logits within tolerance of tp=1, every rank's weights exactly as predicted, the same modules replaced."""
    assert res["status"] == "ok", res.get("failure")
    assert res["correctness"]["passed"], res["correctness"]
    p, got = predict(res), m.weights_per_rank(res)
    assert got == p.weights, (config_label(res["config"]), res["config"]["tp"], got, p.weights)
    assert res["engine"]["modules"]["added"] == p.modules["added"]
    return p, got


def test_every_trim_on_internlm2_tiny_eager_and_meta_at_tp2(tmp_path, cache_dir):
    """trim=all through both placements of the embedding (before init: eager; after it: checkpoint= meta), with
    trim.last_logits: InternLM2's code drops logits_to_keep, so the (sharded) head is handed every prompt position
    until the trim cuts it to the last, and the output stays correct."""
    args = ["-m", "model=internlm2_tiny", "tp=2", "trim=all", "trim.last_logits=true", "load=eager,meta"]
    # the default generate (16 new tokens): its tp=1 reference is the one the other InternLM2 sweeps compare with
    # (a reference is shared by every trim), computed once a session; read from result.json (tracking off)
    args += ["tracking=none"]
    run_dsexp([*args, "hydra.sweep.dir=multirun/s"], tmp_path, cache_dir)
    results = sweep_results(tmp_path / "multirun" / "s")
    assert [r["config"]["load"]["name"] for r in results] == ["eager", "meta"]
    for res in results:
        check_run(res)
        for rk in res["ranks"]:
            done = rk["engine"]["trims"]
            assert (
                done["shard_head"]["replaced_by"] == "LmHeadLinearAllreduce"
                and done["shard_head"]["module"] == "output"
            )
            assert done["shard_head"]["bytes_after"] * 2 == done["shard_head"]["bytes_before"]
            emb = done["shard_embedding"]
            assert emb["replaced_by"] == "VocabParallelEmbedding" and emb["rows"] == [
                512 * rk["rank"],
                512 * (rk["rank"] + 1),
            ]
            d = done["dedupe_buffers"]
            assert (d["buffers"], d["distinct_after"], d["held_before_engine"]) == (6, 3, 3)
            assert done["world_group"]["group"].startswith("world")
            cut = done["last_logits"]
            assert cut["applied"] and cut["head"] == "LmHeadLinearAllreduce" and cut["calls_cut"] >= 2, cut
    said = " ".join(f.text for f in diagnose(results[0], predict(results[0])) if f.code == "trims")
    assert "last_logits: the head (LmHeadLinearAllreduce) given the last position only in" in said, said
    when = [r["engine"]["trims"]["shard_embedding"]["when"] for r in results]
    assert when == ["before init_inference", "after init_inference"]
    assert not results[1]["engine"]["finalize"]["buffers"]["not_found"]  # held buffers are not reported missing


def _matrix_rows(results):
    out = []
    for res in results:
        p, got = check_run(res)
        base = copy.deepcopy(res)
        base["config"]["trim"] = {}
        base.pop("engine")
        untrimmed = predict(base).weights
        trims = label(res["config"]["trim"])
        err = max(abs(a - b) / b for a, b in zip(got, p.weights))
        out.append(
            f"| {res['config']['model']['name']} | {trims} | {res['config']['tp']} | {untrimmed[0]:,} | "
            f"{p.weights[0]:,} | {' / '.join(f'{g:,}' for g in got)} | {err:.1e} | "
            f"{res['correctness']['logits_rel_err']:.2e} |"
        )
    return out


@pytest.mark.slow
def test_full_trim_matrix_exact_and_correct_at_tp2_and_tp4(tmp_path, cache_dir):
    """Every trim alone and all together, tp=2,4, internlm2_tiny and the Llama-layout tiny model: exact per-rank
    weights and outputs within tolerance of tp=1; writes results/cpu/trims.md."""
    lines = []
    for n, trim in enumerate([*(f"trim.{k}=true" for k in TRIMS), "trim=all"]):
        args = ["-m", "model=internlm2_tiny,tiny", "tp=2,4", trim, "generate.new_tokens=4"]
        run_dsexp([*args, f"hydra.sweep.dir=multirun/s{n}"], tmp_path, cache_dir, timeout=1500)
        results = sweep_results(tmp_path / "multirun" / f"s{n}")
        assert len(results) == 4
        lines += _matrix_rows(results)
    header = [
        "<!-- generated by tests/test_trims.py::test_full_trim_matrix_exact_and_correct_at_tp2_and_tp4 -->",
        "CPU (gloo, bf16), `generate.new_tokens=4`: weights per rank in bytes (parameters + buffers on the rank's "
        "device after init), the memory model's prediction without and with the trim, the census of every rank, "
        "and the first-step logits' relative L2 error against the tp=1 reference (tolerance 5e-2).",
        "",
        "| model | trims | tp | predicted untrimmed | predicted | measured per rank | rel. err | logits rel. err |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    (ROOT / "results" / "cpu" / "trims.md").write_text("\n".join(header + lines) + "\n")


def test_every_trim_with_load_sharded_on_a_llama_whose_head_is_named_lm_head(tmp_path, cache_dir):
    """load=sharded with trim=all on the tiny Llama at tp=2: the embedding is cut after init_inference, as on the
    meta load. Cut before it, on load=sharded's meta model, AutoTP cut the head `lm_head` on both dims ((512, 128) of
    (1024, 256)) where the split run's eager model kept (1024, 128), and the fill from the split's files failed."""
    args = ["model=tiny", "tp=2", "trim=all", "load=sharded", "tracking=none", "hydra.run.dir=job"]
    run_dsexp(args, tmp_path, cache_dir)
    res = json.loads((tmp_path / "job" / "result.json").read_text())
    check_run(res)  # ok, correct against tp=1, every rank's weights as the memory model says
    for rk in res["ranks"]:
        done = rk["engine"]["trims"]
        assert done["shard_embedding"]["when"] == "after init_inference"
        assert done["shard_embedding"]["rows"] == [512 * rk["rank"], 512 * (rk["rank"] + 1)]
        assert "named lm_head" in done["shard_head"]["skipped"]


def test_shard_embedding_on_a_model_whose_embedding_is_its_own_class_is_refused_before_launch():
    """Gemma's input embedding scales the rows it looks up (GemmaTextScaledWordEmbedding): DeepSpeed's
    VocabParallelEmbedding replaces an nn.Embedding only, and trim=all on tiny_gemma at tp=2 failed in init. Now a
    ConfigError before launch, naming the class and the key to switch off; the other trims still run."""
    base = ["model=tiny_gemma", "tp=2", "engine.injection_policy=infer"]
    with pytest.raises(ConfigError) as e:
        spec_of(*base, "trim=all")
    for words in ("trim.shard_embedding", "GemmaTextScaledWordEmbedding", "trim.shard_embedding=false"):
        assert words in str(e.value), str(e.value)
    spec = spec_of(*base, "trim=all", "trim.shard_embedding=false")
    assert spec.trim.shard_head and spec.trim.dedupe_buffers and not spec.trim.shard_embedding
    assert spec_of(*base[:1], "tp=1", "trim=all").trim.shard_embedding  # tp=1: the trim does nothing, nothing refused
