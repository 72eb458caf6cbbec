"""Issue 34: a new user's scripts through the script mode. A remedy never breaks a call the script makes (or is
refused before launch, or recorded as not applied); a failed run reads as what happened; every figure means what it
says. The scripts are written as users write them (tests/data/user_scripts/, or here into tmp_path)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from dsexp.core.remedies import not_applicable
from dsexp.core.schema import ConfigError

from helpers.run import run_dsexp, spec_of, sweep_results

SCRIPTS = Path(__file__).parent / "data" / "user_scripts"


def by_tp(results):
    return {r["config"]["tp"]: r for r in results}


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text).lstrip())
    return path


# --- a remedy never breaks the script's calls ----------------------------------------------------------------


def test_remedies_that_need_an_engine_are_refused_for_a_script_that_calls_none(tmp_path):
    """Plain transformers, no DeepSpeed: host_load would keep its .to(device) from happening and meta_load would
    leave the model unfilled; asked by name they are refused before launch, under `all` they are not applied."""
    plain = write(tmp_path, "plain.py", """
        import sys, torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).to("cuda" if torch.cuda.is_available() else "cpu")
        print(model.generate(torch.tensor([[1, 2, 3]]).to(model.device), max_new_tokens=3))
    """)  # fmt: skip
    for name in ("meta_load", "host_load"):
        with pytest.raises(ConfigError, match=f"script.fix={name} cannot apply: .*plain.py never calls"):
            spec_of(f"script.path={plain}", f"script.fix=[{name}]")
    spec = spec_of(f"script.path={plain}", "script.fix=[all]", "tp=2")
    assert "never calls" in not_applicable("meta_load", spec) and not_applicable("autotp", spec) is None
    sharded = write(tmp_path, "sharded.py", plain.read_text() + "import deepspeed\ndeepspeed.init_inference(model)\n")
    assert not_applicable("meta_load", spec_of(f"script.path={sharded}", "script.fix=[all]")) is None


def test_meta_load_leaves_alone_a_load_that_places_or_shards_the_model_itself(tmp_path):
    from dsexp.rank.workloads.script.fixes import meta_load_obstacle

    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    assert meta_load_obstacle(str(folder), {"torch_dtype": "bfloat16"}) is None
    assert "tp_plan='auto'" in meta_load_obstacle(str(folder), {"tp_plan": "auto"})
    assert "device_map='auto'" in meta_load_obstacle(str(folder), {"device_map": "auto"})
    assert meta_load_obstacle(str(folder), {"device_map": "cpu"}) is None
    assert "not a local model folder" in meta_load_obstacle("org/model", {})


def test_a_head_tied_to_its_embedding_is_named_for_the_fill():
    from transformers import OPTConfig, OPTForCausalLM

    from dsexp.rank.loading.meta import tied_names

    cfg = OPTConfig(vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2,
                    word_embed_proj_dim=16, max_position_embeddings=32)  # fmt: skip
    assert tied_names(OPTForCausalLM(cfg)) == {"lm_head.weight": "model.decoder.embed_tokens.weight"}
    cfg.tie_word_embeddings = False
    assert tied_names(OPTForCausalLM(cfg)) == {}


@pytest.mark.slow  # 90 s on 2 cores (four script runs); the tied head's fill is checked unit-wise above
def test_fix_all_keeps_the_scripts_own_move_and_fills_a_tied_head(tmp_path, cache_dir):
    """Issue 34, 1 and 2: a script that moves its model to its device after loading, on a model whose head is tied
    to its embedding, with script.fix=all at tp=2: meta_load leaves the move to the engine (recorded) and fills the
    tied head, so the run and its world-size-1 reference (tp=1, where dsexp fills the model) are ok and correct."""
    run_dsexp(["-m", f"script.path={SCRIPTS / 'to_device_tied.py'}", "script.args=[--model,'{model_dir}']",
               "model=tiny_opt", "tp=2", "script.fix=[all]", "hydra.sweep.dir=s"], tmp_path, cache_dir)  # fmt: skip
    (res,) = sweep_results(tmp_path / "s")
    assert res["status"] == "ok" and res["correctness"]["passed"], (res.get("failure"), res["runtime"]["reference"])
    assert "failed" not in res["runtime"]["reference"]
    for rk in res["ranks"]:
        applied = rk["script"]["fixes"]["applied"]["meta_load"]
        assert any("to(cpu) before the engine: the device move left to init_inference" in str(a) for a in applied)
        move = next(c for c in rk["script"]["calls"] if c["kind"] == "move")
        assert "error" not in move
    # DeepSpeed's CPU all-reduce op, loaded (or built) as the process group starts: a one-time cost, recorded apart
    # (here the autotp remedy starts the group just before init_inference, so it falls after the script's move)
    built = [e for e in res["ranks"][0]["script"]["events"] if e.get("what") == "op_build"]
    assert built and built[0]["name"] == "deepspeed_shm_comm" and built[0]["in_phase"] == "after_move", built


# --- the lines to change: from what the run recorded, Python that needs nothing from dsexp -----------------------


def script_result(calls, applied=None, status="ok", correctness=None, check=True, reference=None, fix=("all",),
                  not_applicable=None, **extra):  # fmt: skip
    """A script's result.json as the job writes it, with rank 0's recorded calls and remedies."""
    fixes = {"applied": applied or {}, "not_applicable": not_applicable or {}}
    rank = {"rank": 0, "status": status, "phases": {}, "timeline": [], "script": {"calls": calls, "fixes": fixes}}
    return {
        "config": {"script": {"path": "/home/me/gen.py", "fix": list(fix)}, "tp": 2, "check": {"correctness": check},
                   "model": {"name": "local"}},
        "status": status,
        "failure": None if status == "ok" else {"cause": "engine_error", "message": "RuntimeError: boom"},
        "correctness": correctness,
        "runtime": {"device": "cpu", "reference": reference or {}},
        "ranks": [rank],
        **extra,
    }  # fmt: skip


def load_call(kwargs, config_dtype="float32", api="AutoModelForCausalLM.from_pretrained"):
    return {"kind": "load", "api": api, "source": "/data/opt-125m", "kwargs": kwargs,
            "config": {"model_type": "opt", "torch_dtype": config_dtype}}  # fmt: skip


INIT = {"kind": "init", "api": "deepspeed.init_inference", "engine": "init_inference",
        "called_with": {"tensor_parallel": {"tp_size": 2}, "dtype": "torch.float32",
                        "replace_with_kernel_inject": False}}  # fmt: skip


def test_the_lines_to_change_are_built_from_the_run_and_need_nothing_from_dsexp():
    """Issue 34, 5: a float32 model without remote code: no bfloat16, no trust_remote_code, the config it uses
    defined first, no file of this repository named; valid Python."""
    from dsexp.analysis.script_lines import code_lines

    applied = {
        "meta_load": [{"source": "/data/opt-125m", "filled_by": "deepspeed"},
                      "OPTForCausalLM.to(cuda:0) before the engine: the device move left to init_inference"],
        "autotp": [{"replace_with_kernel_inject": False, "injection_policy": {"OPTDecoderLayer": ["self_attn.out_proj",
                                                                                                 "fc2"]}}],
        "drop_unread": ["init_inference's zero= block dropped: init_inference never reads it"],
        "restore_buffers": [{"after_load": {}}],
    }  # fmt: skip
    text = "\n".join(code_lines(script_result([load_call({}), INIT], applied)))
    compile(text, "lines_to_change", "exec")
    assert "bfloat16" not in text and "trust_remote_code" not in text
    assert "examples/" not in text and "dsexp" not in text and "seed_fixed" not in text
    assert text.index("config = AutoConfig.from_pretrained('/data/opt-125m')") < text.index("from_config(config")
    assert "torch_dtype=torch.float32" in text and "OnDevice(dtype=torch.float32" in text
    assert "type(m).__name__ == 'OPTDecoderLayer'" in text and "('self_attn.out_proj', 'fc2')" in text
    engine = [line for line in text.splitlines() if line.startswith("engine = deepspeed.init_inference(")]
    assert len(engine) == 1 and "checkpoint=checkpoint" in engine[0] and "zero" not in engine[0]
    assert "# change: init_inference's zero= block dropped" in text
    # published remote code in bf16: the flags it gave come back
    remote = load_call({"torch_dtype": "torch.bfloat16", "trust_remote_code": True}, "bfloat16")
    text = "\n".join(code_lines(script_result([remote, INIT], {"meta_load": applied["meta_load"]})))
    compile(text, "lines_to_change", "exec")
    assert "AutoConfig.from_pretrained('/data/opt-125m', trust_remote_code=True)" in text
    assert "trust_remote_code=True, torch_dtype=torch.bfloat16)" in text


def test_the_lines_to_change_use_the_scripts_own_name_for_the_model_and_stand_in_script_order():
    """The seed's main.py on the H200 (results/h200/scripts/gpu_tests/seed_script_fixed): its lines to change
    read the run's folder as a literal where the script has `model_dir`, and AutoTP's `model.modules()` stood before
    the lines that build `model`. Now the script's own expression for the folder, and the blocks in a script's order
    (environment, load, before the engine)."""
    from dsexp.analysis.script_lines import SCRIPT_ORDER, code_lines
    from dsexp.core.remedies import ORDER

    assert set(SCRIPT_ORDER) == set(ORDER)  # every remedy has its place in a script
    load = {**load_call({"trust_remote_code": True}), "source_expr": "args.model_path"}
    applied = {
        "context": ["PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"],
        "meta_load": [{"source": "/data/opt-125m", "filled_by": "deepspeed"}],
        "autotp": [{"injection_policy": {"OPTDecoderLayer": ["self_attn.out_proj", "fc2"]}}],
    }
    text = "\n".join(code_lines(script_result([load, INIT], applied)))
    compile(text, "lines_to_change", "exec")
    assert "AutoConfig.from_pretrained(args.model_path, trust_remote_code=True)" in text
    assert "os.path.join(args.model_path, '*.safetensors')" in text and "/data/opt-125m" not in text
    assert text.index("expandable_segments") < text.index("from_config(config") < text.index("model.modules()")


def test_the_load_records_the_scripts_own_expression_for_the_model(tmp_path, monkeypatch):
    """The load hook reads, from the script's line that called from_pretrained (a call over several lines, through a
    library's frames), the source of its first argument."""
    import argparse

    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "fakelib.py").write_text(
        "from dsexp.rank.workloads.script.facts import load_before\n\n"
        "class Auto:\n"
        "    @classmethod\n"
        "    def from_pretrained(cls, *args, **kwargs):\n"
        "        return load_before(args, kwargs)\n"
    )
    (tmp_path / "users_main.py").write_text(
        "from fakelib import Auto\n\n"
        "def load(args):\n"
        "    return Auto.from_pretrained(\n"
        "        args.model_path,\n"
        "        torch_dtype='bfloat16',\n"
        "    )\n\n"
        "def load_by_keyword(folder):\n"
        "    return Auto.from_pretrained(pretrained_model_name_or_path=folder)\n"
    )
    monkeypatch.syspath_prepend(str(lib))
    monkeypatch.syspath_prepend(str(tmp_path))
    import users_main

    record = users_main.load(argparse.Namespace(model_path="/data/opt-125m"))
    assert record["source"] == "/data/opt-125m" and record["source_expr"] == "args.model_path"
    assert users_main.load_by_keyword("/data/x")["source_expr"] == "folder"


# --- a failed run reads as what happened -------------------------------------------------------------------------


def rows(*results):
    from dsexp.analysis.matrix import Row

    return [Row(r, None) for r in results]


def report_text(*results) -> str:
    from dsexp.analysis.sections.your_script import scripts_lines

    return "\n".join(scripts_lines(rows(*results)))


def test_every_variant_failed_is_not_called_correctness_switched_off():
    """Issue 34, 3 and 12: check.correctness on, every variant failed: the report says they failed, not that the
    check was off; with the check off, it says that."""
    load = load_call({})
    failed = [script_result([load], status="failed", fix=f) for f in ((), ("all",))]
    text = report_text(*failed)
    assert "check.correctness=false" not in text
    assert "No variant ran to the end, so none could be checked" in text and "- (run failed)" in text
    off = [script_result([load], status="failed", check=False, fix=f) for f in ((), ("all",))]
    assert "Correctness was not checked here (check.correctness=false)" in report_text(*off)


def test_variants_the_launcher_never_started_have_a_table_not_a_crash():
    """A user's script with an option `--n` (2026-12-03): torchrun's argparse refused it, so no variant has a rank.
    The report's table was built from max() over no ranks and the whole report failed (ValueError)."""
    failed = [script_result([], status="failed", fix=f, ranks=[]) for f in ((), ("all",))]
    text = report_text(*failed)
    assert "| as written | failed: engine_error | - (run failed) | - | - | - | - | - |" in text
    assert "| all | failed: engine_error | - (run failed) | - | - | - | - | - |" in text


def test_a_failed_reference_and_a_remedy_not_applied_are_said_under_the_table():
    """Issue 34, 2: a tp=2 run ok whose world-size-1 reference failed: its correctness cell says why, the reason is
    under the table; a remedy that could not act on the script's call is listed with its reason."""
    ref = {"path": "/c/refs/x.pt", "failed": "RuntimeError in init: strict fill failed"}
    why = {"meta_load": "AutoModelForCausalLM.from_pretrained loaded as written: it passes tp_plan='auto'"}
    generate = {"kind": "generate", "api": "OPTForCausalLM.generate", "phase": "generate", "new_tokens": 6}
    text = report_text(script_result([load_call({}), INIT, generate], reference=ref, not_applicable=why))
    assert "- (reference failed)" in text
    assert "its world-size-1 reference failed (RuntimeError in init: strict fill failed)" in text
    assert "meta_load not applied: AutoModelForCausalLM.from_pretrained loaded as written" in text
    assert "check.correctness=false" not in text
    # a forward-only script (no generate): nothing to compare, said as such, not as a failed reference
    forward_only = report_text(script_result([load_call({}), INIT], reference={"failed": "the script saved no"}))
    assert "- (no generate on rank 0)" in forward_only and "reference failed" not in forward_only


def test_a_script_that_stops_before_loading_gets_words_not_a_traceback(capsys):
    """Issue 34, 4: a script that fails before any from_pretrained: its row says why there is no prediction, in
    words; nothing is printed."""
    from dsexp.analysis.matrix import build_rows
    from dsexp.analysis.sections.weights_table import weights_table

    res = script_result([], status="failed", fix=())
    (row,) = build_rows([res])
    assert row.prediction is None and row.model_error == (
        "the script stopped before loading a model (no from_pretrained or pipeline call)"
    )
    assert "LookupError" not in weights_table([row]) and "Traceback" not in capsys.readouterr().err


def phase(wall_s, **more):
    return {"wall_s": wall_s, "peaks": {}, "host": {}, **more}


def test_a_phase_that_never_ended_has_no_time_and_no_tokens_per_s():
    """Issue 34, 7: a rank killed in generate (its phase known from its heartbeat) or failing in it: no generate
    time, no tokens/s; load and init, which ended, keep theirs."""
    from dsexp.core.records import aggregate_metrics, headline

    ok = {"rank": 0, "phases": {"load": phase(1.0), "init": phase(0.5), "generate": phase(2.0)}, "error": None}
    killed = {"rank": 1, "phases": {"load": phase(1.1), "init": phase(0.6), "generate": phase(2.4, partial=True)}}
    failed = {**killed, "phases": {**killed["phases"], "generate": phase(2.4)}, "error": {"phase": "generate"}}
    for other in (killed, failed):
        ranks = [ok, other]
        h = headline(aggregate_metrics(ranks), ranks, new_tokens=20)
        assert h["generate_s"] is None and h["tokens_per_s"] is None
        assert h["load_s"] == 1.1 and h["init_s"] == 0.6
    ranks = [ok, {**killed, "phases": {**killed["phases"], "generate": phase(2.2)}}]
    assert headline(aggregate_metrics(ranks), ranks, new_tokens=22)["tokens_per_s"] == pytest.approx(10.0)


def test_tokens_per_s_counts_every_sequence_and_every_generate_call():
    """Issue 34, 6: a batch of 4 prompts x 20 new tokens, then a second call of 1 x 10: 90 tokens over both calls'
    time (each the slowest rank's)."""
    from dsexp.job.script_job import generation_speed

    calls = [
        {"kind": "generate", "phase": "generate", "new_tokens": 20, "sequences": 4, "generated_tokens": 80},
        {"kind": "generate", "phase": "generate_2", "new_tokens": 10, "sequences": 1, "generated_tokens": 10},
    ]
    r0 = {"rank": 0, "phases": {"generate": phase(2.0), "generate_2": phase(0.5)}, "script": {"calls": calls}}
    r1 = {"rank": 1, "phases": {"generate": phase(2.5), "generate_2": phase(0.5)}, "script": {"calls": calls}}
    speed = generation_speed([r0, r1])
    assert speed == {"generate_s": 3.0, "tokens_per_s": 30.0, "generated_tokens": 90}
    cut = [{**calls[0]}, {**calls[1], "error": "RuntimeError: killed"}]
    assert generation_speed([{**r0, "script": {"calls": cut}}, r1])["tokens_per_s"] is None


def test_generate_records_every_sequence_of_the_batch():
    import torch

    from dsexp.rank.workloads.script.facts import generate_after

    prompt = torch.ones(4, 7, dtype=torch.long)
    seqs = torch.cat([prompt, torch.arange(80).reshape(4, 20)], dim=1)
    out = generate_after(None, seqs, (), {"input_ids": prompt})
    assert out == {"prompt_tokens": 7, "new_tokens": 20, "sequences": 4, "generated_tokens": 80,
                   "tokens": list(range(20))}  # fmt: skip


def test_a_scripts_budget_search_is_listed_by_batch_with_no_savings_or_recommendation_across_batches():
    """Issue 45: a budget search runs a script one batch a job; its jobs are one table by remedies and batch, not
    several "as written" rows with savings computed between batches, and no recommendation of the smallest batch."""
    jobs = []
    for fix, batch, status in (((), 3, "ok"), ((), 4, "failed"), (("all",), 5, "ok"), (("all",), 6, "failed")):
        r = script_result([load_call({}), INIT], status=status, fix=fix, correctness={"passed": True,
                          "logits_rel_err": 1e-6} if status == "ok" else None)  # fmt: skip
        r["config"]["generate"] = {"batch_size": batch}
        if status == "failed":
            r["failure"] = {"cause": "oom_gpu", "message": "CUDA out of memory"}
        jobs.append(r)
    text = report_text(*jobs)
    assert "at tp=2, a budget search (one job a batch)" in text
    assert "| as written | 3 | ok |" in text and "| as written | 4 | out of memory |" in text
    assert "| all | 6 | out of memory |" in text
    assert "saved per rank" not in text and "Recommended:" not in text
    assert "Which batch fits, and with which remedies: the budget search's answer" in text


def test_a_fixed_variants_tokens_are_compared_with_the_script_as_written_and_a_difference_is_explained():
    """Issue 46: per fixed variant, whether its tokens equal the as-written run's at the same world size; where they
    differ, the remedies that change the arithmetic and the logits' relative error it stays within."""

    def variant(fix, tokens, err, applied=None, do_sample=False):
        call = {"kind": "generate", "api": "generate", "phase": "generate", "prompt_tokens": 4, "new_tokens": 4,
                "tokens": tokens, "kwargs": {"do_sample": do_sample}}  # fmt: skip
        return script_result([load_call({}), INIT, call], applied=applied, fix=fix,
                             correctness={"passed": True, "logits_rel_err": err, "tolerance": 1e-4})  # fmt: skip

    written = variant((), [5, 6, 7, 8], 2e-6)
    same = variant(("meta_load",), [5, 6, 7, 8], 2e-6, applied={"meta_load": {}})
    moved = variant(("all",), [5, 6, 9, 9], 3e-5, applied={"restore_buffers": {}, "trims": {}, "meta_load": {}})
    text = report_text(written, same, moved)
    assert "| same (4 tokens) |" in text and "| **differ** from token 3 of 4 |" in text
    note = next(line for line in text.splitlines() if line.startswith("- all: tokens differ"))
    assert "restore_buffers (the rotary tables recomputed in fp32" in note and "trims (the head" in note
    assert "meta_load" not in note.split(":", 2)[2]  # it moves bytes, not numbers
    assert "within 3.0e-05 of the world-size-1 reference (as written: 2.0e-06), tolerance 1e-04" in note
    sampled = variant(("meta_load",), [5, 1, 1, 1], 2e-6, applied={"meta_load": {}}, do_sample=True)
    note = next(line for line in report_text(written, sampled).splitlines() if "tokens differ" in line)
    assert "no remedy that applied changes the arithmetic" in note and "do_sample=True" in note


def test_a_script_with_no_engine_shows_the_weights_each_rank_held():
    """Issue 34, 9: plain transformers on two ranks: no init phase; each rank's weights are those its model held
    after the script's last call that placed it."""
    from dsexp.analysis import measured as m
    from dsexp.core.result import RankRecord

    rk = {"rank": 0, "script": {"calls": []}, "timeline": [{"phase": "load"}, {"phase": "move"}],
          "phases": {"load": {"weights_device": 0}, "move": {"weights_device": 3 * 2**20}, "generate": {}}}  # fmt: skip
    assert RankRecord(rk).weights_held == 3 * 2**20
    assert m.weights_per_rank({"ranks": [rk, {**rk, "rank": 1}]}) == [3 * 2**20, 3 * 2**20]
    engine = {**rk, "phases": {**rk["phases"], "init": {"weights_device": 2**20}}}
    assert RankRecord(engine).weights_held == 2**20
    assert RankRecord({**rk, "script": {}}).weights_held is None  # dsexp's own job: after init only


def test_a_script_that_ran_well_without_an_engine_is_ok_with_the_fact_and_its_diagnosis():
    """Plain transformers on every rank ran and generated: not a failure. The run is ok, its record has the fact
    no_engine_call, and the diagnosis names the call that would shard it (older records: the failure cause)."""
    from types import SimpleNamespace

    from dsexp.analysis.user_script import causes
    from dsexp.job.script_job import no_engine_call

    load = {"kind": "load", "api": "AutoModelForCausalLM.from_pretrained"}
    ranks = [{"script": {"calls": [load, {"kind": "generate", "api": "OPTForCausalLM.generate"}]}}] * 2
    fact = no_engine_call(SimpleNamespace(tp=2), ranks)
    assert "made no engine call" in fact["message"] and "AutoModelForCausalLM.from_pretrained" in fact["message"]
    assert no_engine_call(SimpleNamespace(tp=2), [{"script": {"calls": [load, INIT]}}] * 2) is None
    ok = script_result([load_call({})], no_engine_call=fact)
    (found,) = [f for f in causes(ok) if f["code"] == "no_engine"]
    assert "deepspeed.init_inference" in found["fix"] and ok["status"] == "ok"
    older = script_result([load_call({})], status="failed")
    older["failure"] = {"cause": "no_engine_call", "message": fact["message"]}
    assert "no_engine" in {f["code"] for f in causes(older)}
    assert "no_engine" not in {f["code"] for f in causes(script_result([load_call({}), INIT]))}


def test_a_rank_torn_down_after_another_failed_says_how_it_ended():
    """A rank stopped by the launcher after the other rank failed records no error of its own: its record gets
    the phase it was in (a script's: after its last call) and how it stopped."""
    import signal

    from dsexp.job.failures import classify, record_how_ranks_ended

    failed = {
        "rank": 0,
        "status": "failed",
        "script": {},
        "phases": {"load": phase(1.0)},
        "timeline": [{"phase": "load"}],
        "error": {
            "phase": "after_load",
            "type": "ValidationError",
            "message": "mics_shard_size",
            "outside_calls": True,
        },
    }
    torn = {"rank": 1, "status": "running", "script": {}, "phases": {"load": phase(1.0)},
            "timeline": [{"phase": "load"}], "error": None}  # fmt: skip
    ranks = [failed, torn]
    exits = {1: -signal.SIGTERM}
    failure = classify(False, 1, ranks, {}, exits=exits)
    assert failure["rank"] == 0
    record_how_ranks_ended(ranks, failure, exits, 1)
    assert torn["error"]["phase"] == "after_load" and torn["status"] == "failed"
    assert torn["error"]["message"] == "rank 1 killed by SIGTERM after rank 0 failed, without an error of its own"
    assert failed["error"]["type"] == "ValidationError"  # a rank's own error is kept
    assert classify(False, 1, ranks, {}, exits={})["rank"] == 0  # read again, the torn-down rank is not blamed


def test_a_single_run_of_a_script_missing_its_input_writes_its_report_and_no_traceback(tmp_path, cache_dir):
    """Issue 34, 4 and 10: without -m, a script whose prompts file is missing fails before loading anything: the
    run writes summary.md beside result.json, the console holds no traceback of dsexp's, the report says in words
    why there is no prediction, and the rank's error is the script's own FileNotFoundError."""
    proc = run_dsexp([f"script.path={SCRIPTS / 'prompts_file.py'}", "model=tiny",
                      "script.args=[--model,'{model_dir}',--prompts,missing.txt]", "hydra.run.dir=one"],
                     tmp_path, cache_dir, check=False)  # fmt: skip
    result = json.loads((tmp_path / "one" / "result.json").read_text())
    assert result["status"] == "failed" and result["failure"]["cause"] == "script_error"
    assert result["ranks"][0]["error"]["type"] == "FileNotFoundError"
    assert result["ranks"][0]["error"]["phase"] == "start"
    summary = (tmp_path / "one" / "summary.md").read_text()
    assert "the script stopped before loading a model" in summary
    assert "LookupError" not in summary and "check.correctness=false" not in summary
    console = proc.stdout + proc.stderr
    assert "Traceback" not in console and "LookupError" not in console, console[-3000:]


class _Recorder:
    """Just what a ScriptSession asks of its PhaseRecorder outside observed calls."""

    record = {"error": None}

    def note(self, **kw):
        self.noted = kw


def test_an_op_deepspeed_builds_is_a_one_time_cost_left_out_of_its_phase():
    """Issue 34, 8: DeepSpeed compiling deepspeed_shm_comm in init (78.8 s on a fresh machine, 0.5 s after): the
    hook times it as a one-time cost of init; the headline's init_s leaves it out and the report says it."""
    import time
    from types import SimpleNamespace

    from dsexp.analysis.sections.your_script import one_time_lines
    from dsexp.job.script_job import without_one_time
    from dsexp.rank.workloads.script.hooks import _patch_op_builder
    from dsexp.rank.workloads.script.session import ScriptSession

    class OpBuilder:
        name = "deepspeed_shm_comm"

        def jit_load(self, verbose=True):
            time.sleep(0.05)
            return "the op"

    spec = SimpleNamespace(script=SimpleNamespace(path="gen.py", args=[], fix=[]))
    session = ScriptSession(_Recorder(), spec, {"device": "cpu"}, 0, 0)
    _patch_op_builder(SimpleNamespace(OpBuilder=OpBuilder), session)
    session.open_phase = session.last_phase = "init"  # inside the script's init_inference call
    assert OpBuilder().jit_load() == "the op"
    (event,) = session.events
    assert event["what"] == "op_build" and event["in_phase"] == "init" and event["seconds"] >= 0.05
    assert event["cached"] in (True, False)

    event = {**event, "seconds": 78.8, "cached": False}
    ranks = [{"rank": r, "phases": {"load": phase(1.0), "init": phase(79.4 + r / 10)},
              "script": {"events": [event]}} for r in (0, 1)]  # fmt: skip
    head = {"load_s": 1.0, "init_s": 79.5}
    without_one_time(head, ranks)
    assert head["init_s"] == pytest.approx(0.7) and head["one_time_s"] == 78.8 and head["load_s"] == 1.0
    (line,) = one_time_lines(rows({**script_result([]), "ranks": [ranks[0]]})[0])
    assert line == ("one-time cost: 78.8 s of init on rank 0 was DeepSpeed building its op deepspeed_shm_comm; "
                    "left out of the phase's time")  # fmt: skip
    # the same op loaded from torch's extensions cache in 0.02 s: nothing to say (it printed "0.0 s" before)
    ranks[0]["script"]["events"] = [{**event, "seconds": 0.02, "cached": True}]
    assert one_time_lines(rows({**script_result([]), "ranks": [ranks[0]]})[0]) == []


# --- input as a new user writes it --------------------------------------------------------------------------


def test_script_fix_all_written_plainly_is_the_list_all():
    script = SCRIPTS / "to_device_tied.py"
    assert spec_of(f"script.path={script}", "script.fix=all").script.fix == ["all"]
    assert spec_of(f"script.path={script}", "script.fix=[all]").script.fix == ["all"]
    assert spec_of(f"script.path={script}").script.fix == []
    with pytest.raises(ConfigError, match="unknown remedy 'fast'"):
        spec_of(f"script.path={script}", "script.fix=fast")


def test_a_model_folder_whose_config_is_not_json_is_refused_before_launch(tmp_path):
    folder = tmp_path / "my-model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "config.json").write_text('{"model_type": "llama", "hidden_size": 64,\n "num_hidden_lay')
    with pytest.raises(ConfigError, match=r"model.path='.*my-model': config.json is not valid JSON \(Unterminated"):
        spec_of("model=local", f"model.path={folder}")


def test_help_says_what_dsexp_does_its_first_commands_the_other_entry_points_and_where_the_report_is(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "dsexp", "--help"], cwd=tmp_path, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert text.startswith("dsexp runs DeepSpeed inference on several ranks") and "powered by Hydra" not in text
    commands = [line.split()[2] for line in text.splitlines() if line.strip().startswith("python -m dsexp")]
    assert commands.count("dsexp") == 5 and "script.path=" in text
    # the plan, the report and the campaigns are modules of their own; a budget search is the app with budget.*
    assert {"dsexp.plan", "dsexp.report", "dsexp.campaign"} <= set(commands) and " -m budget.gpus=" in text
    assert "multirun/<date>/<time>/summary.md" in text and "outputs/<date>/<time>/summary.md" in text
    assert text.index("== Four commands") < text.index("== The other entry points")
    assert text.index("== The other entry points") < text.index("== Configuration groups ==")
    assert "engine: " in text and "model: " in text  # Hydra's groups, after


# --- ranks sharing a GPU ------------------------------------------------------------------------------------


def tp_plan_killed(shared: bool, tp_plan="auto"):
    load = load_call({"dtype": "torch.bfloat16", **({"tp_plan": tp_plan} if tp_plan else {})}, "bfloat16")
    res = script_result([load], status="failed", fix=())
    res["runtime"]["shared_gpu"] = shared
    res["failure"] = {"cause": "rank_crashed", "type": "signal", "rank": 1,
                      "message": "rank 1 was killed by SIGSEGV without a Python error"}  # fmt: skip
    return res


def test_a_tp_plan_script_killed_on_a_shared_gpu_is_named_as_the_crash_hf_tp_is_refused_for():
    """Issue 34, 11 (from the H200 run's record): rank 1 SIGSEGV in generate, ranks sharing one GPU: the diagnosis
    names the cause dsexp's own engine=hf_tp is refused on a shared GPU for; not without a shared GPU or tp_plan."""
    from dsexp.analysis.user_script import causes
    from dsexp.engines.hf_tp import SHARED_GPU_REFUSED

    (found,) = [f for f in causes(tp_plan_killed(True)) if f["code"] == "tp_plan_on_shared_gpu"]
    assert "tp_plan='auto'" in found["text"] and SHARED_GPU_REFUSED in found["text"]
    assert "killed by SIGSEGV" in found["text"] and "a GPU of its own" in found["fix"]
    assert not [f for f in causes(tp_plan_killed(False)) if f["code"] == "tp_plan_on_shared_gpu"]
    assert not [f for f in causes(tp_plan_killed(True, None)) if f["code"] == "tp_plan_on_shared_gpu"]


@pytest.mark.gpu
def test_a_tp_plan_script_on_one_shared_gpu_is_diagnosed(tmp_path, cache_dir):
    """On the GPU machine: transformers' tp_plan at tp=2 with both ranks on one GPU dies by a signal in generate, as
    on the H200 (rank 1 SIGSEGV, rank 0 SIGBUS; torch 2.11): the diagnosis names the shared-GPU crash, and every
    rank's record says how it ended. (Should a later torch fix it, this test fails and engine=hf_tp's refusal on a
    shared GPU can go.)"""
    from dsexp.analysis.user_script import causes

    run_dsexp(["-m", f"script.path={SCRIPTS / 'hf_tp_plan_batch.py'}", "script.args=['{model_dir}']",
               "model=tiny_llama", "tp=2", "launcher.gpus=1", "device=cuda", "hydra.sweep.dir=s"],
              tmp_path, cache_dir)  # fmt: skip
    (res,) = sweep_results(tmp_path / "s")
    assert res["runtime"]["shared_gpu"] and res["status"] == "failed", res.get("failure")
    assert res["failure"]["type"] == "signal", res["failure"]
    assert all(rk["error"] for rk in res["ranks"]), [rk.get("error") for rk in res["ranks"]]
    assert "tp_plan_on_shared_gpu" in {f["code"] for f in causes(res)}, res["failure"]


def test_the_engine_handed_where_transformers_expects_the_model_is_named():
    """DeepSpeed's tutorial writes `pipe.model = deepspeed.init_inference(...)`: transformers 5's pipeline then reads
    generation_config from the InferenceEngine (seen with tests/data/user_scripts/pipeline_textgen.py)."""
    from dsexp.analysis.user_script import causes

    res = script_result([load_call({})], status="failed", fix=())
    message = "AttributeError: 'InferenceEngine' object has no attribute 'generation_config'"
    res["failure"] = {"cause": "script_error", "type": "AttributeError", "message": message}
    (found,) = [f for f in causes(res) if f["code"] == "engine_as_model"]
    assert "`generation_config`" in found["text"] and ".module" in found["fix"]
    res["failure"]["message"] = "AttributeError: 'NoneType' object has no attribute 'generation_config'"
    assert not [f for f in causes(res) if f["code"] == "engine_as_model"]


def test_a_bloom_checkpoint_deepspeed_cannot_fill_from_meta_is_known_before_the_engine():
    """perplexity.py (tests/data/user_scripts) on Bloom with script.fix=all at tp=2 failed in init with
    KeyError 'word_embeddings.weight': DeepSpeed looks Bloom's tensors up without `transformer.`, which files saved
    by transformers keep. The meta load sees it before the engine (the remedy then loads as written)."""
    from transformers import BloomConfig, BloomForCausalLM

    from dsexp.rank.loading.meta import names_deepspeed_looks_up

    model = BloomForCausalLM(BloomConfig(vocab_size=64, hidden_size=16, n_layer=1, n_head=2))
    saved = set(model.state_dict())
    assert ("word_embeddings.weight", "transformer.word_embeddings.weight") in names_deepspeed_looks_up(model, saved)
    as_deepspeed_expects = {k.split(".", 1)[1] if k.startswith("transformer.") else k for k in saved}
    assert names_deepspeed_looks_up(model, as_deepspeed_expects) == []


# --- slow: ten scripts of a new user's kinds, at tp=1 and 2, as written and with every remedy ------------------

# script, model, its arguments, {tp: what the failure message says} where the run fails for a reason of its own
TEN = [
    ("pipeline_textgen.py", "tiny_gpt2", ["--model", "'{model_dir}'"],
     {1: "'InferenceEngine' object has no attribute 'generation_config'",
      2: "AutoTP not supported for model. Please use kernel injection"}),
    ("old_api_mp_size.py", "tiny_opt", ["'{model_dir}'"], {}),
    ("config_dict.py", "tiny_qwen2_tied", ["'{model_dir}'"], {}),
    ("class_based.py", "tiny", ["--model", "'{model_dir}'"], {}),
    ("sample_many.py", "tiny_gpt_neox", ["-m", "'{model_dir}'"], {}),
    ("perplexity.py", "tiny_bloom", ["--model", "'{model_dir}'"], {}),
    ("save_then_shard.py", "tiny", ["--model", "'{model_dir}'"], {}),
    ("cast_then_shard.py", "tiny_llama", ["'{model_dir}'"], {}),
    ("kernel_inject.py", "tiny_gpt2", ["--model", "'{model_dir}'"],
     {1: "This op had not been implemented on CPU backend", 2: "This op had not been implemented on CPU backend"}),
    ("manual_decode.py", "tiny_llama", ["--model", "'{model_dir}'"], {}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("script, model, args, fails", TEN, ids=[t[0] for t in TEN])
def test_ten_scripts_at_tp_1_and_2_as_written_and_fixed(tmp_path, cache_dir, script, model, args, fails):
    """Every run is ok and correct (or ok with no generate call to check: a forward-only script), or failed with
    the cause the script or its libraries really hit (docs/user-guide.md, "Scripts tried")."""
    for res, what in sweep_as_written_and_fixed(tmp_path, cache_dir, script, model, args):
        tp = res["config"]["tp"]
        if tp in fails:
            assert res["status"] == "failed" and fails[tp] in res["failure"]["message"], (what, res.get("failure"))
            continue
        assert_ok_and_correct(res, what)


def sweep_as_written_and_fixed(tmp_path, cache_dir, script, model, args):
    """`script` at tp=1,2 with script.fix=[],[all] on `model`: [(result, what it is)], four of them."""
    run_dsexp(["-m", f"script.path={SCRIPTS / script}", f"script.args=[{','.join(args)}]", f"model={model}",
               "tp=1,2", "script.fix=[],[all]", "script.max_new_tokens=8", "hydra.sweep.dir=s"],
              tmp_path, cache_dir)  # fmt: skip
    results = sweep_results(tmp_path / "s")
    assert len(results) == 4
    return [(r, f"{script} tp={r['config']['tp']} fix={r['config']['script']['fix']}") for r in results]


def assert_ok_and_correct(res, what):
    """Ok; correct against world size 1 where rank 0 called generate, else nothing compared and no tokens/s."""
    assert res["status"] == "ok", (what, res.get("failure"))
    if generate_calls(res):
        assert res["correctness"]["passed"], (what, res["correctness"], res["runtime"]["reference"])
        assert res["headline"]["tokens_per_s"] > 0
    else:
        assert res["correctness"] is None and res["headline"]["tokens_per_s"] is None, what


def generate_calls(res):
    return [c for c in res["ranks"][0]["script"]["calls"] if c["kind"] == "generate"]


# --- slow: the five scripts of issue 34, the same way --------------------------------------------------------

# script, model, its arguments, {tp: (cause, the rank that failed, its message, the other rank's)} where it fails
FIVE = [
    ("padded_batch.py", "tiny_gemma", ["--model_name", "'{model_dir}'"], {}),
    ("prompts_file.py", "tiny_gptj", ["--model", "'{model_dir}'", "--prompts", str(SCRIPTS / "prompts.txt")], {}),
    ("own_group_main.py", "tiny", ["'{model_dir}'"], {}),
    ("own_group_main.py", "tiny_falcon", ["'{model_dir}'"],
     {2: ("engine_error", 0, "shape '[1, 24, 4, 32]' is invalid for input of size 2304", "is invalid for input")}),
    ("plain_transformers.py", "tiny_opt", ["--model", "'{model_dir}'"], {}),  # ok: its fact says no engine call
    ("rank_raises.py", "tiny_qwen2_tied", ["--model", "'{model_dir}'"],
     {2: ("script_error", 1, "ValueError: rank 1 has no prompts to answer",
          "rank 0 killed by SIGTERM after rank 1 failed, without an error of its own")}),
    ("rank_exits.py", "tiny_llama", ["--model", "'{model_dir}'"],
     {2: ("script_error", 1, "SystemExit: the script exited with code 3",
          "rank 0 killed by SIGTERM after rank 1 failed, without an error of its own")}),
]  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("script, model, args, fails", FIVE, ids=[f"{t[0]}-{t[1]}" for t in FIVE])
def test_the_five_scripts_of_issue_34_at_tp_1_and_2_as_written_and_fixed(
    tmp_path, cache_dir, script, model, args, fails
):
    """A padded batch of 4 under AutoTP, a prompts file with two generate calls, a main() with its own process
    group, plain transformers, a rank that raises and one that exits 3: each run ok and correct, or failed with
    the cause it really hit, the rank that hit it named and the other rank's record saying how it ended
    (docs/user-guide.md, "Scripts tried")."""
    runs = sweep_as_written_and_fixed(tmp_path, cache_dir, script, model, args)
    for res, what in runs:
        tp = res["config"]["tp"]
        if tp not in fails:
            assert_ok_and_correct(res, what)
            the_scripts_own_calls_are_recorded(script, res, what)
            continue
        cause, rank, message, other = fails[tp]
        failure = res["failure"]
        assert res["status"] == "failed" and failure["cause"] == cause and failure["rank"] == rank, (what, failure)
        assert message in failure["message"], (what, failure)
        if other is not None:
            (torn,) = [rk for rk in res["ranks"] if rk["rank"] != rank]
            assert torn["status"] == "failed" and other in torn["error"]["message"], (what, torn["error"])
    if script == "padded_batch.py":  # the report's generate calls: a tiny model's bytes read in KiB or MiB
        # the caller is the script's line, not DeepSpeed's InferenceEngine._generate between them
        rows = [ln for ln in (tmp_path / "s" / "summary.md").read_text().splitlines() if "| padded_batch.py:37 |" in ln]
        assert len(rows) == 4 and all(row.split("|")[8].strip().endswith(("KiB", "MiB")) for row in rows), rows


def the_scripts_own_calls_are_recorded(script, res, what):
    from dsexp.analysis.user_script import causes

    calls = generate_calls(res)
    if script == "padded_batch.py":
        assert [c["sequences"] for c in calls] == [4], (what, calls)
    if script == "plain_transformers.py":  # ran well on every rank: the whole model on each, nothing sharded
        assert "made no engine call" in res["no_engine_call"]["message"], what
        assert "no_engine" in {f["code"] for f in causes(res)}, what
    else:
        assert res["no_engine_call"] is None, what
    if script == "prompts_file.py":  # greedy then sampled, on the 3 prompts of the file
        assert [c["kwargs"].get("do_sample") for c in calls] == [False, True], (what, calls)
        assert [c["sequences"] for c in calls] == [3, 3], (what, calls)


def test_a_phase_cut_short_is_drawn_as_one_that_did_not_end():
    """Issue 34, 7, on the timelines (plots, trace.json): a phase the rank's error ended is marked, as one a killed
    rank was in is."""
    from dsexp.core.trace import phase_spans

    rec = {"timeline": [{"phase": "load", "t0": 0.0, "t1": 1.0}, {"phase": "generate", "t0": 1.0, "t1": 3.4}],
           "phases": {"load": {}, "generate": {}}, "error": {"phase": "generate"}}  # fmt: skip
    assert [(s["key"], s["partial"]) for s in phase_spans(rec, 0.0)] == [("load", False), ("generate", True)]
    rec["error"] = None
    assert not any(s["partial"] for s in phase_spans(rec, 0.0))


def test_lines_to_change_pass_a_deepspeed_config_object_as_the_dict_deepspeed_accepts():
    """A script that passed tensor_parallel=DeepSpeedTPConfig(tp_size=2): the run records its str (pydantic's
    "enabled=True tp_size=2 mpu=None tp_group=None"); the engine call in the lines to change must be Python that
    gives DeepSpeed the same setting, not that string."""
    import ast

    from dsexp.analysis.script_lines import Names

    init = {
        "called_with": {"tensor_parallel": "enabled=True tp_size=2 mpu=None tp_group=None", "dtype": "torch.bfloat16"}
    }
    call = Names({"source": "/m", "kwargs": {}}, init).init_call()
    tree = ast.parse(call)
    kw = {k.arg: ast.literal_eval(k.value) for k in tree.body[0].value.keywords if k.arg == "tensor_parallel"}
    assert kw == {"tensor_parallel": {"enabled": True, "tp_size": 2}}
    assert "dtype=torch.bfloat16" in call


@pytest.mark.gpu
def test_the_seeds_script_fixed_on_the_gpus_transformers_reads_as_what_happened(tmp_path, cache_dir):
    """Issue 34, 12 on the GPU machine: the seed's main.py (InternLM2's published remote code) with script.fix=[all]
    at tp=2, ranks sharing the GPU, runs sharded and correct, and the report never says correctness was switched off.
    Its committed pass (results/h200/scripts/gpu_tests/seed_script_fixed) ran on transformers 5.17.0, the release
    that hands remote code a DynamicCache: the fixed script gets through generate there too."""
    from dsexp.compose.config import to_schema
    from dsexp.job.run import prepare_model

    from helpers.run import compose
    from helpers.user_scripts import write_seed_main

    spec = to_schema(compose(["model=internlm2_tiny", f"cache_dir={cache_dir}"]))
    write_seed_main(tmp_path, prepare_model(spec)["model_dir"])
    run_dsexp(["-m", "script.path=main.py", "tp=2", "launcher.gpus=1", "device=cuda", "launcher=deepspeed",
               "script.fix=[all]", "script.max_new_tokens=8", "hydra.sweep.dir=s"], tmp_path, cache_dir)  # fmt: skip
    (res,) = sweep_results(tmp_path / "s")
    report = (tmp_path / "s" / "summary.md").read_text()
    assert res["runtime"]["shared_gpu"] and "check.correctness=false" not in report
    applied = res["ranks"][0]["script"]["fixes"]["applied"]
    assert {"autotp", "meta_load"} <= set(applied), applied  # the fix sharded the model before generate
    assert res["status"] == "ok" and res["correctness"]["passed"], (res.get("failure"), res.get("correctness"))


def test_remote_code_that_indexes_a_dynamic_cache_is_named_with_the_stacks_that_pass_it_a_tuple():
    """Published remote code that treats past_key_values as a tuple, on a transformers that hands it a DynamicCache:
    generate fails with TypeError; the cause names that release and the fix the stacks whose generate does not."""
    from dsexp.analysis.user_script import causes

    res = script_result([load_call({})], status="failed", fix=())
    res["software"] = {"versions": {"transformers": "5.17.0"}}
    res["failure"] = {
        "cause": "script_error",
        "type": "TypeError",
        "message": "'DynamicCache' object is not subscriptable",
    }
    (found,) = [f for f in causes(res) if f["code"] == "remote_code_cache"]
    assert "transformers 5.17.0 hands generate a DynamicCache" in found["text"] and ">= 5.24" in found["fix"]
    res["failure"]["message"] = "TypeError: 'NoneType' object is not subscriptable"
    assert not [f for f in causes(res) if f["code"] == "remote_code_cache"]


def test_the_recommendation_holds_for_the_workload_the_script_ran_not_dsexps_generate_settings():
    """A user's main.py with a batch of 3 prompts of 24 tokens and 16 new tokens: the report said "batch 1, the
    prompt text, 16 new tokens", dsexp's own generate settings, which a script never reads."""
    from dsexp.analysis.matrix import Row
    from dsexp.analysis.sections.recommendation import workload_line

    call = {"kind": "generate", "phase": "generate", "prompt_tokens": 24, "new_tokens": 16, "sequences": 3}
    line = workload_line(Row(script_result([load_call({}), INIT, call, {**call}]), None))
    assert "the script ran (its generate calls): batch 3, a prompt of 24 tokens, 16 new tokens;" in line
    assert line.count("batch 3") == 1 and "batch 1" not in line  # two calls of one shape: said once
    assert "made no generate call" in workload_line(Row(script_result([load_call({}), INIT]), None))


def test_a_generate_call_names_its_callers_file_line_and_function():
    """The report's caller column: `modeling_internlm2.py:1180 chat` for remote code's chat, where the function name
    alone did not say which file; generate's own frames (and wrappers around it) are skipped."""
    from dsexp.rank.workloads.script import facts

    def generate():
        return facts._caller()

    def chat():
        return generate()  # the line the caller names

    line = chat.__code__.co_firstlineno + 1
    assert chat() == f"test_script_hardened.py:{line} chat"
