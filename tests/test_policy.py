"""engine.injection_policy=infer: dsexp's table of known layouts, then DeepSpeed's parser, then the structural rule
(dsexp.models.policy), on meta-device models; the memory model and the diagnosis use the same answer."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import yaml

from dsexp.analysis.diagnosis import diagnose
from dsexp.analysis.memory import predict
from dsexp.engines.base import INFER, effective_policy
from dsexp.engines.placement import place
from dsexp.models.policy import (
    KNOWN,
    decoder_layers,
    deepspeed_policy,
    infer_policy,
    override_text,
    structural_rule,
)
from dsexp.models.writer import meta_model

from helpers.analysis_cases import TINY, config, result, strategy
from helpers.run import CONF

ILM2 = {"InternLM2DecoderLayer": ["attention.wo", "feed_forward.w2"]}
MATRIX = sorted(p.stem for p in (CONF / "model").glob("tiny_*.yaml"))  # the architecture matrix's presets


def preset_model(name: str):
    m = yaml.safe_load((CONF / "model" / f"{name}.yaml").read_text())
    return meta_model(m["arch"], m["dims"], "bf16")[1]


def internlm2_meta():
    return meta_model("internlm2", TINY, "bf16")[1]


def policy_strategy(policy):
    return strategy(policy=policy)


def test_internlm2_is_known_and_the_rule_derives_the_same_where_deepspeed_finds_nothing():
    model = internlm2_meta()
    assert KNOWN["InternLM2DecoderLayer"] == ("attention.wo", "feed_forward.w2")
    found, refusal = deepspeed_policy(model)
    assert found is None and "Not able to determine model policy" in refusal
    rule, why = structural_rule(model)
    assert rule == ILM2 and "attention.wo" in why and "feed_forward.w2" in why
    out = infer_policy(model)
    assert (out["policy"], out["source"], out["agrees"]) == (ILM2, "known", True)


def test_the_matrix_is_there():
    assert len(MATRIX) >= 10 and "tiny_gpt2" in MATRIX


@pytest.mark.parametrize("preset", MATRIX)
def test_the_rule_agrees_with_deepspeeds_parser_on_the_matrix(preset):
    model = preset_model(preset)
    rule, _ = structural_rule(model)
    found, refusal = deepspeed_policy(model)
    out = infer_policy(model)
    if found is None:  # gpt2: AutoTP refuses the family by name; the rule still gives its two projections
        assert "AutoTP not supported" in refusal
        assert (out["source"], out["policy"]) == ("inferred", {"GPT2Block": ["attn.c_proj", "mlp.c_proj"]})
    else:
        assert (out["source"], out["agrees"]) == ("deepspeed", True)
        assert {k: sorted(v) for k, v in rule.items()} == found


class _Cfg(SimpleNamespace):
    pass


class _Attention(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.query = nn.Linear(h, h)
        self.key = nn.Linear(h, h // 2)
        self.value = nn.Linear(h, h // 2)
        self.project = nn.Linear(h, h)  # heads x head_dim == hidden: only the order tells it from `query`


class _Mlp(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.widen = nn.Linear(h, i)
        self.narrow = nn.Linear(i, h)
        self.router = nn.Linear(h, 4)  # out != hidden: never row-parallel


class _Block(nn.Module):
    def __init__(self, h, i):
        super().__init__()
        self.norm_a = nn.RMSNorm(h)
        self.mixer = _Attention(h)
        self.norm_b = nn.RMSNorm(h)
        self.ff = _Mlp(h, i)


class _Model(nn.Module):
    def __init__(self, h=64, i=128):
        super().__init__()
        self.config = _Cfg(hidden_size=h)
        self.embed = nn.Embedding(32, h)
        self.blocks = nn.ModuleList([_Block(h, i), _Block(h, i)])


def test_the_rule_on_names_no_parser_knows():
    with torch.device("meta"):
        model = _Model()
    assert [type(m).__name__ for m in decoder_layers(model)] == ["_Block"]
    rule, why = structural_rule(model)
    assert rule == {"_Block": ["ff.narrow", "mixer.project"]}
    assert "reads 128 features" in why and "the last Linear of the block" in why
    out = infer_policy(model, use_deepspeed=False)
    assert out["source"] == "inferred" and out["policy"] == rule


def test_override_text_is_a_hydra_override():
    assert override_text(ILM2) == "engine.injection_policy={InternLM2DecoderLayer:[attention.wo,feed_forward.w2]}"


def test_infer_ignores_the_presets_policy_and_kernel_injection_takes_none():
    assert effective_policy("infer", False, ILM2) == INFER
    assert effective_policy("infer", True, ILM2) is None
    assert effective_policy("auto", False, ILM2) == ILM2


def test_memory_model_infers_the_same_policy_as_the_engine():
    model = internlm2_meta()
    inferred, modules, notes, error, found = place(model, policy_strategy(INFER), 2, with_policy=True)
    explicit, modules2, _, _ = place(model, policy_strategy(ILM2), 2)
    assert error is None and found["source"] == "known" and any("known" in n for n in notes)
    assert [p.local for p in inferred] == [p.local for p in explicit] and modules == modules2
    assert modules["added"] == {"LinearLayer": 6, "LinearAllreduce": 4}


def test_no_policy_failure_names_the_policy_to_pass():
    cfg = config(2, TINY, name="internlm2_tiny")
    cfg["model"].update(arch="internlm2", trust_remote_code=True)
    cfg["engine"]["injection_policy"] = None
    res = result(
        cfg,
        [0, 0],
        status="failed",
        passed=None,
        failure={
            "cause": "engine_error",
            "rank": 0,
            "phase": "init",
            "message": "AssertionError: Not able to determine model policy automatically. Please provide policy.",
        },
    )
    p = predict(res)
    assert p.error and p.policy["suggested"] and p.policy["policy"] == ILM2
    text = " ".join(f.text for f in diagnose(res, p))
    assert "'engine.injection_policy={InternLM2DecoderLayer:[attention.wo,feed_forward.w2]}'" in text
    assert "engine.injection_policy=infer" in text
