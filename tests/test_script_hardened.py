"""Issue 34: a new user's scripts through the script mode. A remedy never breaks a call the script makes (or is
refused before launch, or recorded as not applied); a failed run reads as what happened; every figure means what it
says. The scripts are written as users write them (tests/data/user_scripts/, or here into tmp_path)."""

from __future__ import annotations

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
