"""Quantization (`quant=` group, dsexp.quant): the config and the refusals before launch, each member's stored bytes
against the library's own tensors (torchao's, DeepSpeed's, quanto's cache), and a CPU sweep whose weights per rank
and KV cache equal the memory model's prediction to the byte, with the quality cost recorded beside each run."""

from __future__ import annotations

import json

import pytest

from dsexp.analysis.labels import config_label
from dsexp.compose.validate import _validate_quant
from dsexp.core.schema import ConfigError
from dsexp.core.tensors import stored_bytes, stored_bytes_of
from dsexp.predict.kv import cache_bytes, split_tokens
from dsexp.quant import QUANTS, label, order_of, tolerance

from helpers.run import ROOT, compose, spec_of

TINY_LINEAR = (512, 256)  # tiny's MLP up-projection: out x in


# --- config and refusals -----------------------------------------------------------------------------------------


def test_quant_group_composes_a_member_with_a_kv_cache():
    q = spec_of("quant=fp8_weight", "quant.kv=4").quant
    assert (q.name, q.kv, q.kv_backend, q.order) == ("fp8_weight", 4, "quanto", "auto")
    assert not spec_of().quant.active
    assert label({"name": "fp8_weight", "kv": 4}) == "q(fp8_weight,kv4)"
    assert label({"name": "none", "kv": None}) is None


def test_a_quantized_configuration_is_named_apart_in_reports():
    plain = config_label(dict(compose(["quant=none"])))
    quantized = config_label(dict(compose(["quant=int8_weight", "quant.kv=2"])))
    assert plain != quantized and quantized.endswith("q(int8_weight,kv2)")


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["quant=fp8"], ["quant=fp8", "device=cpu", "quant=fp8_weight"]),
        (["quant=int4_weight"], ["quant=int4_weight", "device=cpu", "mslk"]),
        (["quant=ds_int4", "engine=zero_inference", "zero=stage3", "quant.head=true"], ["quant.head", "head included"]),
        (["quant=none", "quant.head=true"], ["quant.head=true", "torchao member"]),
        (["quant=int8_weight", "engine=hf_tp", "tp=2", "quant.head=true"], ["engine=hf_tp", "TorchAoConfig"]),
        (["quant=ds_int8"], ["quant=ds_int8", "engine=init_inference", "zero.Init", "PR #4750"]),
        (["quant=fp8_weight", "engine=zero_inference", "zero=stage3"], ["engine=zero_inference", "partition"]),
        (["quant=none", "quant.kv=3"], ["quant.kv=3", "4, 2"]),
        (["quant=none", "quant.kv=4", "quant.kv_backend=bnb"], ["quant.kv_backend='bnb'", "quanto, hqq"]),
        (["quant.name=nf4"], ["quant='nf4'", "fp8_weight"]),  # quant=nf4 itself: Hydra lists the members
        (["quant=fp8_weight", "quant.order=sideways"], ["quant.order='sideways'"]),
        # torchao's int8 as dsexp calls it keeps a scale per row: a group size ran per row and the plan said groups
        (["quant=int8_weight", "quant.group_size=32"], ["quant.group_size=32", "per row", "int4_weight"]),
        # GPT-2's layers are Conv1D: torchao quantized none of them and the run was reported as int8 (rel. err 0)
        (["model=tiny_gpt2", "quant=int8_weight"], ["model=tiny_gpt2", "Conv1D", "run unquantized", "quant.kv"]),
    ],
)
def test_what_cannot_run_is_refused_before_launch_naming_the_key_and_what_would(overrides, words):
    with pytest.raises(ConfigError) as e:
        spec_of(*overrides)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_a_member_that_composes_is_not_refused():
    assert spec_of("quant=int8_weight", "tp=1").quant.name == "int8_weight"  # no policy at tp=1: no AutoTP linears
    assert spec_of("quant=fp8_weight", "tp=2").quant.name == "fp8_weight"
    assert spec_of("quant=int8_weight", "tp=2", "quant.head=true").quant.head  # AutoTP's products as F.linear
    assert spec_of("quant=ds_int4", "engine=zero_inference", "zero=stage3", "tp=2").quant.name == "ds_int4"
    assert spec_of("quant=fp8_weight", "quant.kv=4", "engine=hf_tp", "tp=2").quant.kv == 4


def test_the_device_and_its_compute_capability_decide_for_fp8_and_int4():
    fp8 = spec_of("quant=fp8_weight")  # composes here; switch the member to fp8 and ask for a GPU's verdict
    fp8.quant.name = "fp8"
    _validate_quant(fp8, "cuda", capability=(9, 0))  # Hopper: runs
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9 \(this one: 8\.0\)"):
        _validate_quant(fp8, "cuda", capability=(8, 0))
    fp8.quant.name = "int4_weight"
    _validate_quant(fp8, "cuda", capability=(8, 0))
    fp8.dtype = "fp16"
    with pytest.raises(ConfigError, match="dtype=fp16"):
        _validate_quant(fp8, "cuda", capability=(9, 0))


def test_a_named_card_decides_for_fp8_as_its_own_gpu_would():
    """gpu=<card> gives the budget's GPUs their compute capability: `dsexp.plan quant=fp8 gpu=a100_80gb` planned fp8
    for an A100 (8.0), which cannot run it; now refused as on an A100, and planned on an L40S (8.9) or an H100."""
    fp8 = spec_of("quant=fp8_weight", "gpu=a100_80gb", "budget.gpus=1")
    assert fp8.budget.gpu_capability == "8.0"
    fp8.quant.name = "fp8"
    with pytest.raises(ConfigError, match=r"compute capability >= 8\.9 \(this one: 8\.0\)"):
        _validate_quant(fp8, "cuda")  # the card's, not this machine's GPU
    for card in ("l40s", "h100_80gb", "h200", "rtx4090"):
        spec = spec_of("quant=fp8_weight", f"gpu={card}", "budget.gpus=1")
        spec.quant.name = "fp8"
        _validate_quant(spec, "cuda")
    fp8.budget.gpu_capability = "nine"
    with pytest.raises(ConfigError, match="budget.gpu_capability='nine'"):
        _validate_quant(fp8, "cuda")


def test_a_script_is_measured_as_written_so_quant_is_refused_with_it(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("print('hi')\n")
    with pytest.raises(ConfigError, match="script quantizes"):
        spec_of(f"script.path={script}", "quant=fp8_weight")


def test_the_kv_cache_is_refused_for_a_sliding_window_model():
    from dsexp.quant.kv import problem

    q = {"kv": 4, "kv_backend": "quanto", "kv_group_size": 64, "kv_residual": 128}
    assert "sliding window" in problem(q, {"sliding_window": 4096}, kernel_inject=False)
    assert "kernel_inject" in problem(q, {}, kernel_inject=True)
    assert problem(q, {"sliding_window": None}, kernel_inject=False) is None


def test_order_and_tolerance_come_from_the_member_unless_set():
    assert order_of({"name": "ds_int8", "order": "auto"}) == "stream"
    assert order_of({"name": "fp8_weight", "order": "after"}) == "after"
    own = (QUANTS["int4_weight"].quality_tol, "quant=q(int4_weight)'s own")
    assert tolerance({"name": "int4_weight", "kv": None}, 0.05) == own
    assert tolerance({"name": "none", "kv": None}, 0.05) == (0.05, None)
    assert tolerance({"name": "fp8_weight", "quality_tol": 0.9}, 0.05) == (0.9, "quant.quality_tol")


# --- stored bytes: the member's rule against the library's own tensors --------------------------------------------


def _bf16_linear(out: int, inp: int):
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(inp, out, bias=False)).to(torch.bfloat16)


@pytest.mark.parametrize("member", ["fp8_weight", "int8_weight"])
def test_torchao_stores_what_the_members_rule_says(member):
    from dsexp.quant.torchao_rank import torchao_config

    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    out, inp = TINY_LINEAR
    model = _bf16_linear(out, inp)
    quantize_(model, torchao_config(QUANTS[member], None))
    weight = model[0].weight
    assert type(weight).__name__ in ("Float8Tensor", "Int8Tensor")  # a torchao tensor subclass, not bf16
    assert stored_bytes_of(weight) == QUANTS[member].storage.nbytes(out, inp, 2)
    assert stored_bytes_of(weight) < out * inp * 2 * 0.6  # about half of bf16: counted from its inner tensors


def test_one_linear_at_a_time_quantizes_what_the_whole_model_call_does(monkeypatch):
    """quant.empty_cache=each (the GPU default): quantize_ per linear, the cache emptied after each; the same linears
    quantized to the same bytes as one quantize_ of the model, the head left in bf16."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao")
    from torchao.quantization import quantize_

    from dsexp.quant.torchao_rank import linear_filter, quantize_each, torchao_config

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)  # fmt: skip
    emptied = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(1))
    models = []
    for each in (True, False):
        torch.manual_seed(0)
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        config, keep = torchao_config(QUANTS["int8_weight"], None), linear_filter(m)
        quantize_each(m, config, keep, None) if each else quantize_(m, config, filter_fn=keep)
        models.append(m)
    kinds = [{n: type(p).__name__ for n, p in m.named_parameters()} for m in models]
    assert kinds[0] == kinds[1] and list(kinds[0].values()).count("Int8Tensor") == 2 * 7
    assert kinds[0]["lm_head.weight"] == "Parameter"
    assert stored_bytes(models[0]) == stored_bytes(models[1])
    assert len(emptied) == 2 * 7  # once per linear


def test_one_linear_at_a_time_moves_that_linear_alone_to_the_device():
    """quantize_each with a device (stream order) moves the linear it quantizes, not the modules around it: quantize_
    over the head's parent (the root) moved the whole bf16 rank to the GPU on the H100. The meta device stands in."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao")
    from dsexp.quant.torchao_rank import linear_filter, quantize_each, torchao_config

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)  # fmt: skip
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    head, up = m.lm_head, m.model.layers[0].mlp.up_proj
    keep = linear_filter(m, with_head=True)
    quantize_each(m, torchao_config(QUANTS["int8_weight"], None), lambda mod, fqn: mod in (head, up), "meta")
    assert keep(head, "lm_head") and head.weight.device.type == up.weight.device.type == "meta"
    others = [p for n, p in m.named_parameters() if not n.startswith(("lm_head", "model.layers.0.mlp.up_proj"))]
    assert others and all(p.device.type == "cpu" for p in others)  # the embedding, norms, the other linears


def test_with_head_first_the_output_head_is_quantized_before_the_other_linears():
    """quant.head_first (the default with quant.head): quantize_each takes the output head first, while the device
    holds least, then the other linears in the model's order; without it the head comes last, as the model orders it.
    The meta device stands in for the GPU."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao")
    from dsexp.quant.torchao_rank import linear_filter, quantize_each, torchao_config

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100, tie_word_embeddings=False)  # fmt: skip
    orders = []
    for first in (True, False):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16)
        keep, order = linear_filter(m, with_head=True), []
        quantize_each(m, torchao_config(QUANTS["int8_weight"], None), lambda mod, fqn, k=keep, o=order: k(mod, fqn)
                      and not o.append(fqn), "meta", m.lm_head if first else None)  # fmt: skip
        assert type(m.lm_head.weight).__name__ == "Int8Tensor"
        orders.append(order)
    assert orders[0][0] == "lm_head" and orders[1][-1] == "lm_head" and orders[0][1:] == orders[1][:-1]
    assert len(orders[0]) == 8  # 7 linears of the layer and the head
    assert spec_of("quant=int4_weight", "quant.head=true", gpus=1).quant.head_first is True


def test_the_plan_puts_the_head_first_only_where_the_run_did():
    """int4 with the head quantized at tp=2, every trim (the H100's tp2_int4_head_each_linear: 8.35 GiB at the
    quantize phase's peak, the head last, its packing's temporaries beside every other weight): quantized first, the
    plan's stream peak falls to 5.84 GiB; a run recorded before quant.head_first existed is planned in its own order."""
    import re

    from dsexp.analysis.memory import predict

    recorded = json.loads((GPU / "tp2_int4_head_each_linear" / "0" / "result.json").read_text())
    assert "head_first" not in recorded["config"]["quant"]

    def stream(config):
        (note,) = [n for n in predict({"config": config, "runtime": {"device": "cuda"}}).notes if "load peak" in n]
        return float(re.search(r"stream (\d+\.\d+) GiB", note)[1])

    config = recorded["config"]
    assert stream(config) == 8.35
    first = stream({**config, "quant": {**config["quant"], "head_first": True}})
    weights = max(predict({"config": config, "runtime": {"device": "cuda"}}).weights) / GIB
    assert weights < first <= 5.84 and stream({**config, "quant": {**config["quant"], "empty_cache": "end",
                                                                     "head_first": True}}) == 8.35  # fmt: skip


def test_quant_empty_cache_takes_each_or_end():
    assert spec_of("quant=fp8_weight").quant.empty_cache == "each"
    assert label({"name": "fp8", "empty_cache": "end"}) == "q(fp8,empty-end)"
    with pytest.raises(ConfigError, match="quant.empty_cache='sometimes': choose one of each, end"):
        spec_of("quant=fp8_weight", "quant.empty_cache=sometimes")


@pytest.mark.parametrize("member", ["ds_int8", "ds_int4"])
def test_deepspeeds_quantized_weight_is_as_long_as_the_rule_says(member):
    import torch
    from deepspeed.inference.quantization.utils import Quantizer, concat_to_compat_param

    from dsexp.quant.deepspeed_rank import ds_block

    config = ds_block(QUANTS[member], None)["weight_quantization"]["quantized_initialization"]
    out, inp = TINY_LINEAR
    w = torch.randn(out, inp, dtype=torch.bfloat16)
    q, scale, low = Quantizer(config).quantize(w)
    flat = concat_to_compat_param(q.view(w.dtype), scale.view(w.dtype), low.view(w.dtype))
    assert flat.numel() * flat.element_size() == QUANTS[member].storage.nbytes(out, inp, 2)


@pytest.mark.parametrize("bits, batch, prompt", [(4, 3, 100), (2, 3, 100), (2, 1, 18)])
def test_a_quantized_kv_cache_holds_what_the_rule_says(bits, batch, prompt):
    """transformers' quanto cache after a generate, to the byte; at 2 bits on 34 tokens of one sequence (34 groups a
    layer's keys) quanto pads its packed values to 36 groups (the rule had said 32 B a tensor less)."""
    import torch

    pytest.importorskip("optimum.quanto")
    from transformers import LlamaConfig, LlamaForCausalLM

    from dsexp.quant.kv import generate_kwargs
    from dsexp.rank.generation import cache_bytes as measured_bytes

    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=256)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    new, residual = 21, 8
    ids = torch.randint(0, 256, (batch, prompt))
    quant = {"kv": bits, "kv_backend": "quanto", "kv_group_size": 64, "kv_residual": residual}
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                             return_dict_in_generate=True, **generate_kwargs(quant))  # fmt: skip
    split = split_tokens(prompt, new, residual)
    assert (split.quantized, split.residual) == (prompt + 16, 4)  # 20 decode steps: two flushes of 8, 4 kept
    assert measured_bytes(out.past_key_values) == cache_bytes(2, 2, 32, batch, split, bits, 64, 2)


# --- a CPU sweep: weights and KV cache measured against the memory model, the quality cost beside each run ------------


@pytest.fixture(scope="module")
def quant_sweep(tmp_path_factory, cache_dir):
    """fp8 weights with a 4-bit KV cache at tp=1 and 2 (AutoTP's shards quantized after it), and DeepSpeed's int4 as
    ZeRO-3 builds the model at tp=2: three CPU jobs of the tiny Llama."""
    from helpers.run import run_dsexp, sweep_results

    cwd = tmp_path_factory.mktemp("quant")
    common = ["tracking=none", "generate.new_tokens=20", "quant.kv_residual=8"]
    run_dsexp(["-m", "quant=fp8_weight", "quant.kv=4", "tp=1,2", *common, "hydra.sweep.dir=multirun/a"], cwd, cache_dir)
    run_dsexp(["-m", "quant=ds_int4", "engine=zero_inference", "zero=stage3", "tp=2", *common,
               "hydra.sweep.dir=multirun/b"], cwd, cache_dir)  # fmt: skip
    return sweep_results(cwd / "multirun" / "a") + sweep_results(cwd / "multirun" / "b")


@pytest.mark.slow  # a live CPU sweep (~2 min); the default suite holds the committed one: below
def test_each_ranks_quantized_weights_equal_the_prediction_to_the_byte(quant_sweep):
    from dsexp.analysis import measured as m
    from dsexp.analysis.memory import predict

    assert [r["status"] for r in quant_sweep] == ["ok"] * 3
    for r in quant_sweep:
        measured, predicted = m.weights_per_rank(r), predict(r).weights
        assert measured == predicted, (config_label(r["config"]), measured, predicted)
    bf16 = predict({**quant_sweep[0], "config": {**quant_sweep[0]["config"], "quant": {"name": "none"}}}).weights
    assert m.weights_per_rank(quant_sweep[0])[0] < 0.7 * bf16[0]  # the quantization shows: not the bf16 bytes


@pytest.mark.slow  # a live CPU sweep (~2 min); the default suite holds the committed one: below
def test_the_kv_cache_measured_equals_its_quantized_prediction(quant_sweep):
    from dsexp.analysis.matrix import build_rows
    from dsexp.analysis.workload_points import point_rows
    from dsexp.predict.kv import split_tokens

    rows = point_rows(build_rows(quant_sweep[:2]))
    assert len(rows) == 2
    for p in rows:  # 19 decode steps over a residual of 8: 16 tokens quantized with the prompt, 3 kept in bf16
        assert split_tokens(p.prompt_tokens, 20, 8).residual == 3
        assert p.measured == p.predicted and p.measured[0] > 0, (p.config, p.measured, p.predicted)


@pytest.mark.slow  # a live CPU sweep (~2 min); the default suite holds the committed one: below
def test_the_quality_cost_is_recorded_against_the_unquantized_tp1_run(quant_sweep):
    for r in quant_sweep:
        c = r["correctness"]
        assert c["against"] == "tp=1, unquantized, same dtype" and c["quant"].startswith("q(")
        assert 0 < c["logits_rel_err"] <= c["tolerance"] and c["passed"]
        assert 0 <= c["token_agreement"] <= 1
    phases = quant_sweep[0]["ranks"][0]["phases"]
    assert "quantize" in phases and phases["quantize"]["weights_device"] < phases["init"]["weights_device"]


# --- the seed's dead path, and the quality beside a budget's answer ------------------------------------------------


def test_a_script_asking_init_inference_for_int8_is_told_the_path_is_gone_and_what_does_it():
    from dsexp.analysis.user_script import int8_dtype

    result = {
        "failure": {
            "cause": "config_rejected",
            "message": "ValueError: Data type torch.int8 is not supported by cuda accelerator",
        },
        "software": {"versions": {"deepspeed": "0.19.8"}},
    }
    (finding,) = int8_dtype(result)
    assert "DeepSpeed 0.19.8 rejects init_inference(dtype=torch.int8)" in finding["text"] and "#2956" in finding["text"]
    assert "quant=int8_weight" in finding["fix"] and "quant=ds_int8" in finding["fix"]
    assert int8_dtype({"failure": {"message": "ValueError: Data type torch.bfloat16 is fine"}}) == []


def test_dtype_int8_in_a_config_is_refused_naming_the_quant_members():
    with pytest.raises(ConfigError) as e:
        spec_of("dtype=int8")
    assert "init_inference(dtype=torch.int8)" in str(e.value) and "quant=fp8_weight" in str(e.value)


def test_a_quantized_answer_says_its_quality_and_whether_it_passed():
    from dsexp.analysis.sections.budget_answer import quality_text

    ok = {"quant": "q(int8_weight)", "logits_rel_err": 0.0124, "tolerance": 0.15, "passed": True, "token_agreement": 1}
    assert "logits rel. err 0.0124 (within 0.15), greedy tokens agree 1.00" in quality_text(ok)
    assert "**past** 0.15" in quality_text({**ok, "logits_rel_err": 0.4, "passed": False})
    assert quality_text(None) == ""


@pytest.mark.slow  # one CPU job (~30 s); the finding's rule is held above on its record
def test_a_script_calling_init_inference_with_int8_is_diagnosed_end_to_end(tmp_path, cache_dir):
    from helpers.run import ROOT, run_dsexp

    script = ROOT / "tests" / "data" / "user_scripts" / "int8_dtype.py"
    args = [f"script.path={script}", "script.args=[--model,'{model_dir}']", "tracking=none", "hydra.run.dir=o"]
    proc = run_dsexp(args, tmp_path, cache_dir, check=False)
    assert "config_rejected: ValueError: Data type torch.int8 is not supported" in proc.stdout
    summary = (tmp_path / "o" / "summary.md").read_text()
    assert "rejects init_inference(dtype=torch.int8)" in summary and "quant=int8_weight" in summary
    assert "rejects a field of its config" not in summary


# --- the composition matrix, committed: measured against the model as the code says it now --------------------------

COMPOSE = ROOT / "results" / "cpu" / "quant_compose"  # the CPU's composition matrix
GPU = ROOT / "results" / "h200" / "quant"  # llama_20b_shapes on an H100 80GB


def compose_runs(folder=COMPOSE):
    import json

    return [json.loads(p.read_text()) for p in sorted(folder.glob("*/*/result.json"))]


def test_every_committed_gpu_run_of_a_member_holds_the_predicted_weights_to_the_byte():
    from dsexp.analysis import measured as m
    from dsexp.analysis.memory import predict

    ran = [r for r in compose_runs(GPU) if m.weights_per_rank(r) and (r["config"].get("quant") or {}).get("name")]
    members = {r["config"]["quant"]["name"] for r in ran}
    assert {"fp8", "fp8_weight", "int8_weight", "int4_weight", "ds_int8", "ds_int4"} <= members
    for r in ran:
        assert m.weights_per_rank(r) == predict(r).weights, config_label(r["config"])


def test_a_quantized_run_reads_the_unquantized_checkpoint_and_its_page_cache_is_predicted_so():
    """The checkpoint a member loads is the run dtype's: ZeRO-3 inference's ds_int8 on the H100 mapped the 36.99 GiB
    bf16 checkpoint at load (37.41 GiB of file pages with the interpreter's), and the model's page cache says so, equal
    to the unquantized run's (it had said 10.41 GiB, the quantized weights, and read a folder when one was here)."""
    import dataclasses
    import json

    from dsexp.analysis.memory import facts_of
    from dsexp.engines.placement import RULES
    from dsexp.predict import job as model

    ds_int8 = json.loads((GPU / "zero3" / "0" / "result.json").read_text())
    assert ds_int8["config"]["quant"]["name"] == "ds_int8" and ds_int8["config"]["load"]["name"] == "eager"
    facts = dataclasses.replace(facts_of(ds_int8), model_dir=None)  # the writer's shards, no folder read
    mapped = max(model.predict(ds_int8["config"], RULES, facts).host.file)
    unquantized = {**ds_int8["config"], "quant": {**ds_int8["config"]["quant"], "name": "none"}}
    assert mapped == max(model.predict(unquantized, RULES, facts).host.file)
    measured = ds_int8["ranks"][0]["phases"]["load"]["peaks"]["host_file_peak"]
    assert 36.9 * 2**30 < mapped <= measured < mapped + 2**30


def test_every_committed_cpu_run_of_a_member_holds_the_predicted_weights_to_the_byte():
    from dsexp.analysis import measured as m
    from dsexp.analysis.memory import predict

    ran = [r for r in compose_runs() if r["status"] == "ok"]
    members = {(r["config"]["quant"]["name"], r["config"]["tp"]) for r in ran}
    for member in ("fp8_weight", "int8_weight", "ds_int8", "ds_int4"):
        assert (member, 1) in members and (member, 2) in members, member
    # int8 under AutoTP (its products as F.linear) and with the output head quantized, at tp=1 and 2
    engines = {(r["config"]["quant"]["name"], r["config"]["tp"], r["config"]["quant"].get("head", False)):
               r["config"]["engine"]["name"] for r in ran}  # fmt: skip
    assert engines[("int8_weight", 2, False)] == engines[("int8_weight", 2, True)] == "init_inference"
    assert ("int8_weight", 1, True) in engines
    # each load, and every trim with each, under AutoTP at tp=2 (campaign quant_compose's loads and loads_trims)
    loads = {(r["config"]["quant"]["name"], r["config"]["load"]["name"], (r["config"].get("trim") or {}).get("name"))
             for r in ran if r["config"]["engine"]["name"] == "init_inference" and r["config"]["tp"] == 2}  # fmt: skip
    for load in ("eager", "meta", "sharded"):
        assert ("int8_weight", load, "all") in loads, load
    assert {("fp8_weight", "sharded", "none"), ("int8_weight", "sharded", "none")} <= loads
    # a head tied to the embedding, quantized: AutoTP's clone at tp=2, quantize_'s own weight at tp=1
    tied = {r["config"]["tp"] for r in ran if r["config"]["model"]["name"] == "tiny_qwen2_tied"}
    assert tied == {1, 2}
    # and every quantized KV cache at 4 and 2 bits, tp=1 and 2, to the byte (quanto's padding of 2 bits included)
    from dsexp.analysis.matrix import build_rows
    from dsexp.analysis.workload_points import point_rows

    kv = [r for r in ran if r["config"]["quant"].get("kv")]
    assert {(r["config"]["quant"]["kv"], r["config"]["tp"]) for r in kv} >= {(4, 1), (4, 2), (2, 1), (2, 2)}
    for p in point_rows(build_rows(kv)):
        assert p.measured == p.predicted and p.measured[0] > 0, (p.config, p.measured, p.predicted)
    for r in ran:
        assert m.weights_per_rank(r) == predict(r).weights, config_label(r["config"])


def test_each_refusal_is_what_the_library_did_when_it_ran():
    """Every combination the campaign ran with the composition check off and that failed is one dsexp now refuses,
    and the refusal cites the library's own error; every one that ran is not refused."""
    from dsexp.compose.validate import _validate_quant
    from dsexp.core.schema import JobConfig, from_dict

    seen = 0
    # the GPU's plain runs (not a budget search's points, whose failures are the search's; not the interrupted)
    gpu = [r for r in compose_runs(GPU) if not (r["config"].get("budget") or {}).get("gpu_gib")]
    for r in compose_runs() + [r for r in gpu if "interrupted" not in str(r.get("failure"))]:
        spec = from_dict(JobConfig, r["config"], strict=False)
        spec.quant.check_composition = True
        try:
            _validate_quant(spec, spec.device, capability=(9, 0))
            refused = None
        except ConfigError as e:
            refused = str(e)
        if r["status"] == "ok":
            assert refused is None, (config_label(r["config"]), refused)
            continue
        seen += 1
        error = (r.get("failure") or {}).get("message") or ""
        if "aten.transpose" in error:  # AutoTP's matmul by weight.T: dsexp runs those products as F.linear since
            assert refused is None and QUANTS[spec.quant.name].autotp_linear, config_label(r["config"])
            continue
        assert refused is not None, (config_label(r["config"]), error)
        cited = {"amax()": "cannot partition", "amin()": "cannot partition",
                 "takes no DeepSpeed config": "takes no DeepSpeed config", "DTensor": "DTensor"}  # fmt: skip
        assert any(k in error and v in refused for k, v in cited.items()), (error, refused)
    assert seen >= 4  # torchao under ZeRO-3, int4 under AutoTP (adapted), DeepSpeed's elsewhere, torchao after hf_tp


@pytest.mark.slow  # two CPU jobs (~40 s); the answer's quality line is held above on its record
def test_quant_is_a_dimension_of_the_budget_search_and_its_answer_gives_the_quality_cost(tmp_path, cache_dir):
    """A search of the search's logic (the CPU's simulated budget, the memory model's own boundary): bf16 does not
    fit, both quantized members run, and the answer and the runner-up say what each costs in quality."""
    from helpers.run import run_dsexp

    args = ["-m", "model=tiny", "generate.prompt_tokens=64", "generate.new_tokens=4", "budget.gpus=1",
            "budget.gpu_gib=0.0035", "budget.batch_max=16", "quant=none,fp8_weight,int8_weight", "tracking=none",
            "hydra.sweep.dir=sw"]  # fmt: skip
    out = run_dsexp(args, tmp_path, cache_dir).stdout
    assert "not launched: quant=none" in out
    summary = (tmp_path / "sw" / "summary.md").read_text()
    answer = next(line for line in summary.splitlines() if line.startswith("- **Answer**"))
    assert "quant=" in answer and "quality against tp=1 unquantized: logits rel. err" in answer and "within" in answer
    assert "Runner-up" in summary and summary.count("greedy tokens agree") >= 2


def test_int4s_largest_batch_stays_under_its_kernels_32_bit_output_limit(capsys, tmp_path):
    """int4's tinygemm kernel ran 2^31 output elements of a 16384-wide linear and faulted past them (139264 tokens,
    and 72 x 2048: results/h200/quant): the plan's answer, and the budget search's first guess with it, stop there."""
    from helpers.plan import plan

    common = ("model=llama_20b_shapes", "gpu=h100_80gb", "budget.gpu_gib=60", "generate.prompt_tokens=[1024,2048]")
    # the allocated bytes' answer (--no-replay) passes the limit: the limit caps it
    status, [entry], text, _ = plan(capsys, tmp_path, "--no-replay", "quant=int4_weight", *common)
    assert status == 0
    fit = entry["largest_batch"]["2048"]
    assert fit["allocated_bytes_bound"] > 64 and fit["largest_batch"] == 64  # 2^31 // 16384 // 2048
    assert fit["kernel_limit"]["tokens"] * 16384 <= 2**31 < (fit["kernel_limit"]["tokens"] + 1) * 16384
    assert entry["largest_batch"]["1024"]["kernel_limit"]["batch"] == 128
    assert "the quantized kernel's limit 64" in text
    # 60 GiB at 2048 + 16 new tokens, as the H100 searched it (budget60_each): the replay fits 66, the kernel 64
    _, [h100], _, _ = plan(capsys, tmp_path, "quant=int4_weight", *common[:3], "generate.prompt_tokens=2048",
                           "generate.new_tokens=16", "generate.warmup=0")  # fmt: skip
    fit = h100["largest_batch"]["2048"]
    assert fit["replayed"]["default"]["batch"] > 64 and fit["largest_batch"] == 64, fit
    _, [tp2], _, _ = plan(capsys, tmp_path, "--no-replay", "quant=int4_weight", "tp=2", "launcher.gpus=1", *common)
    assert tp2["largest_batch"]["2048"]["kernel_limit"]["widest_out"] == 8192  # a rank's half of the up projection
    assert tp2["largest_batch"]["2048"]["kernel_limit"]["batch"] == 128
    _, [int8], _, _ = plan(capsys, tmp_path, "--no-replay", "quant=int8_weight", "model=tiny_llama", *common[1:3],
                           "generate.prompt_tokens=96")  # fmt: skip
    assert "kernel_limit" not in int8["largest_batch"]["96"]  # no such limit outside int4


def test_the_replay_traces_torchaos_members_on_the_meta_device_and_says_where_it_cannot(capsys, tmp_path):
    """The plan's allocator replay quantizes the rank model on the meta device with the member's own call and traces
    its generate (fp8's float32 temporaries, int8's dequantized weight, int4's packed weights and tinygemm's product,
    whose torch meta kernel needs a FakeTensor: dsexp stands in for it); the quantized KV cache is not traced, and the
    plan says so beside the allocated bytes' answer."""
    from helpers.plan import plan

    common = ("model=tiny_llama", "gpu=h100_80gb", "budget.gpu_gib=0.8", "generate.prompt_tokens=96",
              "generate.new_tokens=4")  # fmt: skip
    status, entries, _, _ = plan(capsys, tmp_path, "-m", "quant=none,int8_weight,fp8,int4_weight", *common)
    fits = {e["quant"]["name"] if "quant" in e else i: e["largest_batch"]["96"] for i, e in enumerate(entries)}
    assert status == 0 and len(fits) == 4, fits.keys()
    plain, int8, fp8, int4 = (fits[k] for k in fits)
    for fit in (plain, int8, fp8, int4):
        assert fit["answer_from"] == "replay:default", fit
        assert fit["largest_batch"] <= fit["allocated_bytes_bound"]
    assert fp8["largest_batch"] < int8["largest_batch"] < plain["largest_batch"]  # fp8's inputs in float32
    _, [kv], _, _ = plan(capsys, tmp_path, "quant=int8_weight", "quant.kv=4", *common)
    assert "quantized KV cache" in kv["largest_batch"]["96"]["replayed"]["not_replayed"]
    # at tp=2 the rank model is cut as AutoTP cuts the run-dtype weights, then quantized (its cut was once taken
    # from the quantized bytes: a generate that fails on a shape, said to fail on the GPU too, where it ran)
    _, [tp2], _, _ = plan(capsys, tmp_path, "quant=int8_weight", "tp=2", "launcher.gpus=1", *common)
    assert tp2["largest_batch"]["96"]["answer_from"] == "replay:default", tp2["largest_batch"]["96"]


def test_fp8_with_and_without_fp8_activations_are_different_structures_to_the_replay():
    """The replay keeps one trace per structure: fp8's weights and fp8_weight's hold the same tensors and differ in
    the settings the weight carries (torchao's act_quant_kwargs). They once shared a fingerprint: a plan of
    quant=fp8,fp8_weight gave fp8_weight fp8's 37 sequences where alone it gives 52 (llama_20b_shapes, 60 GiB)."""
    import copy
    import types

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao")
    from dsexp.predict.structure import fingerprint
    from dsexp.quant.on_meta import quantize_on_meta

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)  # fmt: skip
    with torch.device("meta"):
        base = LlamaForCausalLM(cfg).to(torch.bfloat16)
    prints = []
    for member in ("fp8", "fp8_weight", "int8_weight", "fp8"):
        m = copy.deepcopy(base)
        quantize_on_meta(
            m, types.SimpleNamespace(quant=member, quant_group=None, quant_head=False, quant_empty_cache="each")
        )
        prints.append(fingerprint(m))
    assert len(set(prints)) == 3 and prints[0] == prints[3]  # three structures; one member's copies share one


def test_quantizing_with_the_cache_emptied_at_the_end_is_replayed_as_the_h100_measured_it():
    """quant.empty_cache=end: one quantize_ of the model, each linear moved in bf16, quantized, its bf16 weight
    freed, the cache emptied once after. Recorded on the meta device and replayed through the allocator, fp8 at
    llama_20b_shapes, tp=1, holds the bytes the H100 allocated after the phase and at its peak to the byte, and
    reserves within 1% of what it reserved (results/h200/quant/empty_cache, the `end` job)."""
    import types

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao")
    from dsexp.predict.allocator import Allocator
    from dsexp.quant.on_meta import allocation_order, quantize_on_meta

    [end] = [
        r for r in compose_runs(GPU) if "empty_cache/" in r["job_dir"] and "empty-end" in config_label(r["config"])
    ]
    measured = end["ranks"][0]["phases"]["quantize"]["gpu"]
    cfg = LlamaConfig(hidden_size=6144, intermediate_size=16384, num_hidden_layers=48, num_attention_heads=48,
                      num_key_value_heads=8, vocab_size=92544)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    quantize_on_meta(model, types.SimpleNamespace(quant="fp8", quant_group=None, quant_head=False,
                                                  quant_empty_cache="end"))  # fmt: skip
    events = allocation_order(model)
    assert events[-1][0] == "release" and any(kind == "free" for kind, _, _ in events)
    state = Allocator().run(events)
    assert state.allocated == measured["gpu_alloc"] and state.peak_allocated == measured["gpu_alloc_peak"]
    assert abs(state.reserved / measured["gpu_reserved"] - 1) < 0.01
    assert abs(state.peak_reserved / measured["gpu_reserved_peak"] - 1) < 0.01


def test_the_allocators_release_event_frees_the_cached_segments_nothing_uses():
    from dsexp.predict.allocator import Allocator

    state = Allocator().run([("alloc", 1, 64 << 20), ("alloc", 2, 64 << 20), ("free", 1, 0), ("release", None, 0)])
    assert state.allocated == 64 << 20 and state.reserved == 64 << 20 and state.peak_reserved == 128 << 20


def test_a_quantized_rank_allocates_each_linears_inner_tensors_then_the_rest():
    """The replay's weights for stream order with the cache emptied after each linear: per quantized linear its data
    then its scales, then what module.to moves; together the model's stored bytes."""
    import types

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    pytest.importorskip("torchao")
    from dsexp.quant.on_meta import allocation_order, quantize_on_meta

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=100)  # fmt: skip
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    quantize_on_meta(
        model, types.SimpleNamespace(quant="fp8", quant_group=None, quant_head=False, quant_empty_cache="each")
    )
    sizes = allocation_order(model)
    q_proj = [64 * 64, 64 * 4]  # fp8 data, a float32 scale per row
    rest = [t for t in (*model.parameters(), *model.buffers()) if type(t).__name__ != "Float8Tensor"]
    assert sizes[:2] == q_proj and len(sizes) == 2 * 2 * 7 + len(rest)
    assert sum(sizes) == stored_bytes(model)


def test_the_plan_names_what_quantizing_leaves_in_the_allocator_and_the_fix_that_measured_best(capsys, tmp_path):
    from helpers.plan import plan

    common = ("quant=fp8_weight", "model=tiny_llama", "gpu=h100_80gb", "generate.prompt_tokens=64", "--no-replay")
    _, [each], _, _ = plan(capsys, tmp_path, *common)
    _, [end], _, _ = plan(capsys, tmp_path, "quant.empty_cache=end", *common)
    assert any("quant.empty_cache=each" in n and "0.10 GiB" in n for n in each["notes"])
    assert any("quant.empty_cache=end" in n and "the replay records" in n for n in end["notes"])


QUANT_GPU = ROOT / "results" / "h200" / "quant"
GIB = 2**30
QUANTIZE_PEAKS = [  # a committed job of each member in stream order (quant.empty_cache=each), and its quantize phase
    "budget60_each/2",  # int8_weight, tp=1
    "budget60_each/6",  # fp8, tp=1
    "budget60_each/12",  # int4_weight, tp=1
    "tp2_trimmed/1",  # fp8, tp=2 trimmed, ranks sharing the GPU
    "tp2_trimmed/2",  # int4_weight, tp=2 trimmed
    "tp2_int4_head_each_linear/0",  # int4_weight with the head quantized (its packing: about 3 GiB of temporaries)
]


def test_the_plans_quantize_peak_is_what_each_h100_quantize_phase_allocated():
    """The plan's load peak in stream order (the weights arriving quantized, one in bf16 with its quantize's
    temporaries traced on the meta device) against the allocated peak of every committed quantize phase on the H100:
    within 1.5% (int4 at tp=2 without the head 5.70 against 5.77 GiB; with it 8.35, as measured, where the plan said
    5.83 before it traced the packing's temporaries)."""
    import re

    from dsexp.engines.placement import RULES
    from dsexp.predict.job import Facts, predict

    for job in QUANTIZE_PEAKS:
        result = json.loads((QUANT_GPU / job / "result.json").read_text())
        measured = max(rk["phases"]["quantize"]["gpu"]["gpu_alloc_peak"] for rk in result["ranks"])
        pred = predict(result["config"], RULES, Facts(device="cuda"))
        (note,) = [n for n in pred.notes if n.startswith("quant load peak")]
        planned = float(re.search(r"stream (\d+\.\d+) GiB", note)[1]) * GIB
        assert abs(planned / measured - 1) < 0.015, (job, planned / GIB, measured / GIB)


def test_the_targets_benchmark_reads_each_target_from_the_committed_runs(monkeypatch):
    """benchmarks/quant_targets.py (without its largest-batch replays): the weights per GPU against the issue's
    targets as the H100 measured them (fp8 at tp=2 trimmed 9.78 GiB, met; int4 5.69, not met; with the head 5.30,
    met), the plan equal to every run, and int4 with the head's load peak above the bound, stated, also with the head
    quantized first (the plan only)."""
    import importlib.util
    import re

    spec = importlib.util.spec_from_file_location("quant_targets", ROOT / "benchmarks" / "quant_targets.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    text = bench.report(fast=True)
    rows = {line.split(" | ")[0].lstrip("| "): line for line in text.splitlines() if line.startswith("| llama")}
    assert "| 9.78 | 9.78 | +0.00% | <= 10.00 | met |" in rows["llama_20b_shapes tp=2 trim=all fp8"]
    assert "| 5.69 | 5.69 | +0.00% | <= 5.50 | **not met** |" in rows["llama_20b_shapes tp=2 trim=all int4_weight"]
    assert "| 5.30 | 5.30 | +0.00% | <= 5.50 | met |" in rows["llama_20b_shapes tp=2 trim=all int4_weight head"]
    assert "within 1% of every GPU run above: met" in text
    equal, runs = map(int, re.search(r"To the byte on the CPU: (\d+) of (\d+) runs", text).groups())
    assert equal == runs >= 20
    head = [line for line in text.splitlines() if "int4_weight head" in line and "| each |" in line]
    assert any("| 8.35 | 8.35 | 5.67 | **not met** |" in line for line in head)
    assert any("quant.head_first | each | - | 5.84 | 5.67 | **not met** by the plan" in line for line in head)


def test_load_sharded_splits_the_model_unquantized_whatever_the_member(tmp_path, monkeypatch):
    """load=sharded's one-off split saves each rank's slice in the run dtype, as the engine cut it: the member
    quantizes after each run's load. Quantized in the split, torchao's tensors failed safetensors' save ("Attempted to
    access the data pointer on an invalid python storage", campaign quant_compose's loads step, fifth session)."""
    from dsexp.job import split

    asked = []
    monkeypatch.setattr(split, "run_role", lambda spec, *a, **k: asked.append(spec) or (_ for _ in ()).throw(OSError()))
    spec = spec_of("quant=int8_weight", "load=sharded", "tp=2")
    assert spec.quant.name == "int8_weight"
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors").write_bytes(b"0")
    spec.cache_dir = str(tmp_path / "cache")
    with pytest.raises(OSError):
        split.ensure_split(spec, {"model_dir": str(model_dir), "device": "cpu"}, tmp_path / "job")
    (role,) = asked
    assert role.quant.name == "none" and not role.quant.active and role.tp == 2 and role.load.name == "sharded"
    none = spec_of("load=sharded", "tp=2")
    none.cache_dir = spec.cache_dir
    assert split.split_dir(spec, model_dir) == split.split_dir(none, model_dir)  # one split serves every member


def test_the_members_rule_names_fused_experts_it_leaves_in_the_run_dtype():
    """transformers 5 holds Mixtral's experts as 3-D parameters (experts.gate_up_proj, experts.down_proj), which
    torchao's quantize_ (nn.Linear layers) passes over: int8 on tiny_mixtral quantized 8 linears, its attention's.
    The plan says so, with their bytes, rather than leave a user to think the experts are int8."""
    from dsexp.compose.planning import plan_one, space

    (entry,) = [plan_one(p, replay=False) for p in space(["model=tiny_mixtral", "quant=int8_weight",
                                                          "gpu=h100_80gb"], False)]  # fmt: skip
    (rule,) = [n for n in entry["notes"] if n.startswith("quant=int8_weight:")]
    assert rule.startswith("quant=int8_weight: 8 weights")
    assert (
        "also in the run dtype: model.layers.*.mlp.experts.down_proj, model.layers.*.mlp.experts.gate_up_proj" in rule
    )
    (plain,) = [plan_one(p, replay=False) for p in space(["model=tiny", "quant=int8_weight", "gpu=h100_80gb"], False)]
    assert not [n for n in plain["notes"] if "experts" in n]


def test_a_plan_recommending_a_quant_member_says_its_quality_is_a_runs_to_measure():
    """`dsexp.plan -m quant=none,int4_weight gpu=l40s` recommends int4 for its batch: the plan predicts memory, and
    the recommendation says the member's quality cost is measured by running it (it said nothing of quality)."""
    from dsexp.analysis.sections.plan_table import recommendation_line
    from dsexp.compose.planning import plan_one, space

    entries = [
        plan_one(p, replay=False)
        for p in space(
            ["model=llama_20b_shapes", "quant=none,int8_weight", "gpu=l40s", "generate.prompt_tokens=2048"], True
        )
    ]
    line = recommendation_line(entries)
    assert line.startswith("recommended: `quant=int8_weight`"), line
    assert "quant=int8_weight's quality cost is measured by running it" in line
    assert "quality" not in recommendation_line([e for e in entries if "int8" not in e["configuration"]])


def test_the_plans_recommendation_never_offers_a_batch_past_int4s_kernel_limit(capsys, tmp_path):
    """int4 under 60 GiB: the replay fits 72 with expandable segments, but tinygemm faults past 2^31 output elements
    (64 x 2048 tokens through a 16384-wide linear; the H100 faulted at 72). The recommendation offered "72 with
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"; the kernel's limit holds for either allocator."""
    from dsexp.analysis.sections.plan_table import recommendation_line
    from dsexp.compose.planning import plan_one, space

    overrides = ["model=llama_20b_shapes", "quant=int4_weight", "budget.gpus=1", "budget.gpu_gib=60",
                 "generate.prompt_tokens=2048", "generate.warmup=0"]  # fmt: skip
    (entry,) = [plan_one(p) for p in space(overrides, False)]
    fit = entry["largest_batch"]["2048"]
    assert fit["largest_batch"] == fit["kernel_limit"]["batch"] == 64
    assert fit["replayed"]["expandable_segments"]["batch"] > 64  # what the memory alone would hold
    line = recommendation_line([entry])
    assert "batch 64 at 2048" in line and "expandable_segments" not in line, line
