"""Remote code as its authors published it: InternLM2's rotary buffers are computed in __init__ only, which
transformers >= 5 leaves uninitialised. dsexp recomputes them on every load (eager, meta, sharded) and records it;
a tp=1 reference that is still not finite is `reference_invalid`, naming the buffers."""

from __future__ import annotations

import pytest
import transformers

from dsexp.analysis.labels import config_label
from dsexp.compose.config import to_schema
from dsexp.core.compat import transformers_version

from helpers.loading import assert_sharded
from helpers.run import compose, run_dsexp, sweep_results


@pytest.fixture(scope="module")
def loads(tmp_path_factory, cache_dir):
    """experiment=autotp at tp=2, each load; read from result.json (tracking off). Its eager load is also the AutoTP
    engine's run (test_engines.py's sweep leaves it to this one)."""
    cwd = tmp_path_factory.mktemp("published")
    run_dsexp(
        [
            "-m",
            "experiment=autotp",
            "model=internlm2_tiny",
            "tp=2",
            "load=eager,meta,sharded",
            "tracking=none",
            "hydra.sweep.dir=multirun/s",
        ],
        cwd,
        cache_dir,
    )
    return {r["config"]["load"]["name"]: r for r in sweep_results(cwd / "multirun" / "s")}


@pytest.mark.parametrize("load", ["eager", "meta", "sharded"])
def test_every_load_is_correct_with_its_buffers_recomputed(loads, load):
    res = loads[load]
    assert res["status"] == "ok" and res["correctness"]["passed"], res.get("failure")
    for rank in res["ranks"]:
        after_load = rank["phases"]["load"]["loader"]["buffers"]
        after_engine = rank["engine"]["finalize"]["buffers"]["restored"]
        assert after_load["checked"] == 3 * 2  # inv_freq, cos and sin tables in each of the 2 layers
        if load == "eager" and transformers_version() >= (5,):  # from_pretrained left all of them uninitialised
            assert len(after_load["recomputed"]) == after_load["checked"]
        if load != "eager":  # built from the constructor on meta: right after load, changed by the engine
            assert after_load["from_constructor"] and after_load["recomputed"] == {}
            assert after_engine and set(after_engine.values()) <= {"cast", "changed", "nonfinite", "meta"}
    if load == "meta":  # AutoTP filled each rank's part from the checkpoint, in its dtype
        assert res["engine"]["finalize"]["filled_by"] == "deepspeed" and res["runtime"]["conversion"] is None
    if load == "sharded":
        assert_sharded(res, 2)


def test_autotp_with_the_preset_policy_shards_and_matches_tp1(loads):
    """The AutoTP engine (experiment=autotp, tp=2, the default eager load): the preset policy splits every decoder
    layer, embeddings and output stay whole, and the output matches tp=1 (moved from test_engines.py: the same job)."""
    res = loads["eager"]
    assert res["config"]["variant"] == "autotp" and res["config"]["tp"] == 2
    assert res["status"] == "ok", res.get("failure")
    assert res["correctness"]["passed"], res["correctness"]  # first-step logits match the tp=1 eager reference
    eng = res["engine"]
    assert eng["injection_policy"] == {"InternLM2DecoderLayer": ["attention.wo", "feed_forward.w2"]}
    assert eng["modules"] == {"removed": {"Linear": 10}, "added": {"LinearLayer": 6, "LinearAllreduce": 4}}
    for rk in res["ranks"]:
        assert 0.5 < rk["engine"]["weight_fraction"] < 0.75  # layers halved, embeddings and output whole
    replicated = set(res["ranks"][1]["engine"]["replicated"])
    assert {
        "model.tok_embeddings.weight",
        "output.weight",
        "model.layers.0.attention.rotary_emb.cos_cached",
    } <= replicated
    assert "model.layers.0.attention.wqkv.weight" not in replicated
    assert eng["unread_fields"] == ["max_out_tokens"]  # only the kernels read it


def test_a_load_keeping_its_buffers_as_loaded_has_its_own_label():
    """restore_buffers=false is another configuration (its numerics differ): never the same row as the default."""
    import dataclasses

    def label(*overrides):
        return config_label(dataclasses.asdict(to_schema(compose(["experiment=autotp", *overrides]))))

    assert label("load.restore_buffers=false") == label().replace("/eager/", "/eager+buffers_as_loaded/")
    assert "buffers_as_loaded" not in label("load=meta")


def poisoned_reference(tmp_path, cache_dir, value: str) -> dict:
    """A tp=2 job whose buffers, in the reference run too, are left as loaded and filled with `value` (the
    test-only poison_buffers fault: what transformers >= 5 leaves, made deterministic)."""
    run_dsexp(
        [
            "-m",
            "experiment=autotp",
            "model=internlm2_tiny",
            "tp=2",
            "load.restore_buffers=false",
            "debug=fault",
            f"fault={{kind: poison_buffers, value: {value}, roles: true}}",
            f"cache_dir={tmp_path / 'cache'}",
            "hydra.sweep.dir=multirun/poisoned",
        ],
        tmp_path,
        cache_dir,
    )
    (res,) = sweep_results(tmp_path / "multirun" / "poisoned")
    return res


@pytest.mark.slow  # minutes on 2 cores: make test-all
def test_a_nan_reference_is_reference_invalid_naming_the_buffers(tmp_path, cache_dir):
    """NaN buffers make the tp=1 reference NaN: its own cause, never an infinite error."""
    res = poisoned_reference(tmp_path, cache_dir, "nan")
    failure = res["failure"]
    assert (res["status"], failure["cause"]) == ("failed", "reference_invalid")
    assert "not finite" in failure["message"] and "rotary_emb.inv_freq" in failure["message"]
    assert "on stack current" in failure["message"] and "inf" not in str(res.get("correctness") or "")
    assert res["software"]["versions"]["transformers"] == transformers.__version__  # what its reference ran on


@pytest.mark.slow  # minutes on 2 cores: make test-all
def test_a_finite_reference_from_wrong_buffers_is_reference_invalid(tmp_path, cache_dir):
    """Zeroed tables (what fresh memory gave on the H200) give finite logits that are not the model's; every wrong
    load then agrees with the wrong reference, so only the buffers' check can tell: reference_invalid, naming
    them and how they differ."""
    res = poisoned_reference(tmp_path, cache_dir, "0")
    failure = res["failure"]
    assert (res["status"], failure["cause"]) == ("failed", "reference_invalid"), failure
    assert "differ from what the model's constructor computes" in failure["message"]
    assert "rotary_emb.cos_cached (changed)" in failure["message"]
    assert "restore_buffers=true" in failure["message"]
