"""A user's own script, run as written under dsexp's probes (script.path), diagnosed from what it did, and fixed
through the hooks (script.fix). The scripts are written here as users write them (tests/helpers/user_scripts.py):
the seed's main.py verbatim but for its model path, and the lines the public threads show.

Default suite: the seed's script on today's stack, as written (rejected) and with script.fix=all (sharded and
correct); a rank that raises; bad input refused before launch; the bootstrap's reach. `make test-all` (slow): the seed
on its own stack at tp=1 and 2, as written and fixed, and the other scripts at tp=1 and 2, each with its cause named."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from dsexp.analysis.labels import config_label
from dsexp.analysis.sections.your_script import _group_key
from dsexp.analysis.user_script import what_it_did
from dsexp.compose.config import to_schema
from dsexp.compose.validate import validate
from dsexp.core.protocol import SCRIPT_ENV, SCRIPT_JOB_ENV, bootstrap_dir
from dsexp.core.schema import ConfigError
from dsexp.job.run import job_key, prepare_model

from helpers.run import compose, run_dsexp, sweep_results
from helpers.user_scripts import write_script, write_seed_main

TINY_INTERNLM2 = ["model=internlm2_tiny"]


def model_dir(cache_dir: Path, *overrides: str) -> str:
    spec = to_schema(compose([*overrides, f"cache_dir={cache_dir}"]))
    return prepare_model(spec)["model_dir"]


def codes(result) -> set:
    from dsexp.analysis.diagnosis import diagnose
    from dsexp.analysis.memory import predict

    try:
        prediction = predict(result)
    except Exception:
        prediction = None
    return {f.code for f in diagnose(result, prediction)}


def by_fix(results):
    return {tuple(r["config"]["script"]["fix"]): r for r in results}


def weights_per_rank(result):
    return [rk["phases"]["init"]["weights_device"] for rk in result["ranks"]]


@pytest.fixture(scope="module")
def seed_today(tmp_path_factory, cache_dir):
    """The seed's main.py on today's stack at tp=2 under the DeepSpeed launcher, as written and with every remedy
    (read from result.json: tracking off)."""
    cwd = tmp_path_factory.mktemp("seed_today")
    write_seed_main(cwd, model_dir(cache_dir, *TINY_INTERNLM2))
    run_dsexp(
        ["-m", "script.path=main.py", "tp=2", "launcher=deepspeed", "script.fix=[],[all]",
         "script.max_new_tokens=8", "tracking=none", "hydra.sweep.dir=s"],
        cwd, cache_dir,
    )  # fmt: skip
    return by_fix(sweep_results(cwd / "s"))


def test_the_seeds_script_as_written_is_rejected_by_todays_deepspeed_and_recorded(seed_today):
    res = seed_today[()]
    assert res["status"] == "failed" and res["failure"]["cause"] == "config_rejected"
    assert "mics_shard_size" in res["failure"]["message"]
    assert [rk["error"]["phase"] for rk in res["ranks"]] == ["after_load", "after_load"]  # loaded, then rejected
    assert "rejected_field" in codes(res)
    assert res["config"]["script"]["path"].endswith("main.py") and "script:main.py" in config_label(res["config"])


def test_the_seeds_script_fixed_is_sharded_and_correct(seed_today):
    res = seed_today[("all",)]
    assert res["status"] == "ok" and res["correctness"]["passed"], res.get("failure")
    assert res["correctness"]["logits_rel_err"] <= res["correctness"]["tolerance"]
    applied = res["ranks"][0]["script"]["fixes"]["applied"]
    assert {"autotp", "drop_unread", "meta_load", "trims"} <= set(applied)
    assert any("mics_shard_size dropped" in str(x) for x in applied["drop_unread"])
    full = res["ranks"][0]["script"]["calls"][0]["placement_after"]
    assert full["on_meta"] > 0  # meta_load: built on the meta device, no private host copy
    model_bytes = sum(
        c["placement_after"]["bytes"] for c in res["ranks"][0]["script"]["calls"] if c["kind"] == "init"
    )  # what rank 0 holds after the engine
    assert all(w < 0.75 * 2 * model_bytes for w in weights_per_rank(res))
    # the rejected field is gone, kernel injection replaced by AutoTP: the engine split every decoder layer
    init = next(c for c in res["ranks"][0]["script"]["calls"] if c["kind"] == "init")
    assert init["classes_after"].get("LinearAllreduce", 0) > 0


# a script's failing rank end to end by default: test_script_hardened.py's single run of a script missing its input;
# a rank that raises while the other waits: rank_raises.py among the slow five scripts there
@pytest.mark.slow
def test_a_rank_that_raises_is_recorded_with_its_phase_and_traceback(tmp_path, cache_dir):
    write_script(tmp_path, "raises.py", model_dir(cache_dir, "model=tiny"))
    run_dsexp(["-m", "script.path=raises.py", "tp=2", "check.correctness=false", "hydra.sweep.dir=s"], tmp_path,
              cache_dir)  # fmt: skip
    (res,) = sweep_results(tmp_path / "s")
    fail = res["failure"]
    assert res["status"] == "failed" and fail["cause"] == "script_error" and fail["rank"] == 1, fail
    err = res["ranks"][1]["error"]
    assert err["phase"] == "after_load" and "the last rank gives up" in err["traceback"]
    assert "load" in res["ranks"][0]["phases"] and res["ranks"][0]["status"] in ("ok", "failed", "running")


def spec_of(*overrides):
    return validate(to_schema(compose(list(overrides))), gpus=0)


def test_bad_script_input_is_refused_before_launch(tmp_path):
    with pytest.raises(ConfigError, match="script.path='nowhere.py' does not exist"):
        spec_of("script.path=nowhere.py")
    script = write_script(tmp_path, "raises.py", "/m")
    with pytest.raises(ConfigError, match="unknown remedy 'faster'"):
        spec_of(f"script.path={script}", "script.fix=[faster]")
    with pytest.raises(ConfigError, match="script.fix=context cannot apply: .*device=cpu"):
        spec_of(f"script.path={script}", "script.fix=[context]")
    with pytest.raises(ConfigError, match="trims need DeepSpeed >= 0.19.8.*0.14.4"):
        spec_of(f"script.path={script}", "stack=seed", "tp=2", "script.fix=[trims]")
    assert spec_of(f"script.path={script}", "stack=seed", "tp=2", "script.fix=[all]").script.fix == ["all"]


def test_scripts_and_their_arguments_never_share_a_row_or_a_key(tmp_path):
    script = write_script(tmp_path, "raises.py", "/m")
    a = spec_of(f"script.path={script}", "script.args=[--n,1]")
    b = spec_of(f"script.path={script}", "script.args=[--n,2]")
    c = spec_of(f"script.path={script}", "script.args=[--n,2]", "script.fix=[all]")
    d = spec_of(f"script.path={script}", "script.args=[--n,1]", "launcher=deepspeed")
    labels = {config_label(dataclasses.asdict(s)) for s in (a, b, c, d)}
    assert len(labels) == 4 and all(lbl.startswith("script:raises.py --n") for lbl in labels)
    # the report's table of fixes: one per configuration, so the two launchers' runs as written are two tables
    fixed = spec_of(f"script.path={script}", "script.args=[--n,1]", "script.fix=[all]")
    torchrun, torchrun_fixed, deepspeed = (
        _group_key(SimpleNamespace(config=dataclasses.asdict(s), tp=s.tp)) for s in (a, fixed, d)
    )
    assert torchrun == torchrun_fixed and torchrun[:-1] == deepspeed[:-1] and torchrun != deepspeed
    assert len({job_key(s) for s in (a, b, c)}) == 3
    before = job_key(a)
    script.write_text(script.read_text() + "\n# edited\n")
    assert job_key(a) != before  # an edited script is another configuration


def test_the_bootstrap_reaches_only_the_scripts_ranks(tmp_path):
    """Active only where RANK is set and argv[0] is the script: the launcher itself and other Pythons are untouched.
    Active, it writes the rank's record; inactive, nothing."""
    job = tmp_path / "job"
    (job / "ranks").mkdir(parents=True)
    script = tmp_path / "s.py"
    script.write_text("print('ran')\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(bootstrap_dir()), os.environ.get("PYTHONPATH", "")]),
        SCRIPT_JOB_ENV: str(job),
        SCRIPT_ENV: str(script),
    }
    other = subprocess.run([sys.executable, "-c", "print('other')"], env={**env, "RANK": "0"}, capture_output=True)
    assert other.returncode == 0 and not (job / "ranks" / "rank0.json").exists()
    no_rank = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True)
    assert no_rank.stdout.strip() == "ran" and not (job / "ranks" / "rank0.json").exists()
    # a rank without a job file: the bootstrap says why it measures nothing and the script still runs
    rank = subprocess.run(
        [sys.executable, str(script)], env={**env, "RANK": "0", "WORLD_SIZE": "1"}, capture_output=True, text=True
    )
    assert rank.returncode == 0
    log = (job / "ranks" / "rank0.log").read_text()
    assert "ran" in log and "could not start" in log and "job.json" in log


# --- slow: every script at tp=1 and 2 ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_seeds_script_on_its_own_stack_runs_unsharded_with_a_private_copy_per_rank(tmp_path, cache_dir):
    """transformers 4.42.4 + DeepSpeed 0.14.4: it runs; kernel injection replaces nothing on InternLM2 (no policy),
    the zero block is never read, and each rank loads a private host copy (a ~300 MiB model, so the copy stands out
    of the interpreter's own memory). With script.fix=all the same file is sharded at tp=2 and correct."""
    dims = [
        "model.dims.hidden_size=1024",
        "model.dims.num_hidden_layers=8",
        "model.dims.vocab_size=32000",
        "model.dims.intermediate_size=2816",
        "model.dims.num_attention_heads=16",
        "model.dims.num_key_value_heads=8",
    ]
    from dsexp.analysis.memory import predict

    write_seed_main(tmp_path, model_dir(cache_dir, *TINY_INTERNLM2, *dims))
    run_dsexp(["-m", "script.path=main.py", "tp=1,2", "launcher=deepspeed", "stack=seed", "script.max_new_tokens=4",
               "script.fix=[],[all]", "hydra.sweep.dir=s"], tmp_path, cache_dir)  # fmt: skip
    results = sweep_results(tmp_path / "s")
    fixed = next(r for r in results if r["config"]["script"]["fix"] and r["config"]["tp"] == 2)
    assert fixed["status"] == "ok" and fixed["correctness"]["passed"], (fixed.get("failure"), fixed["correctness"])
    as_written = [r for r in results if not r["config"]["script"]["fix"]]
    # fixed: sharded, as the memory model says (DeepSpeed 0.14.4 keeps the head and the embedding whole: 71% here)
    assert max(weights_per_rank(fixed)) < 0.75 * max(weights_per_rank(as_written[0]))
    assert predict(fixed).weights == weights_per_rank(fixed)
    one, two = sorted(as_written, key=lambda r: r["config"]["tp"])
    assert one["status"] == two["status"] == "ok", (one.get("failure"), two.get("failure"))
    assert weights_per_rank(two) == weights_per_rank(one) * 2  # nothing sharded
    found = codes(two)
    assert {"kernel_injection_without_policy", "zero_block_unread", "host_copy_per_rank"} <= found, found
    unread = next(e for e in two["ranks"][0]["script"]["events"] if e.get("kind") == "final")["unread"]
    assert "zero" in unread
    printed = two["ranks"][0]["phases"]["load"]["see_memory_usage"]  # the seed's own see_memory_usage, rank 0
    assert printed["message"] == "After load model" and isinstance(printed["MA_GB"], float)
    # what the fix changes in the output: its tokens beside the as-written run's at tp=2, a difference explained
    from dsexp.analysis.matrix import Row
    from dsexp.analysis.sections.your_script import scripts_lines, token_difference

    diff = token_difference(Row(fixed, None), Row(two, None))
    assert diff is not None and diff[1] > 0  # both recorded their first generate's tokens
    text = "\n".join(scripts_lines([Row(r, None) for r in results]))
    assert "tokens vs as written" in text
    assert (diff[0] is None) == ("tokens differ from the script as written's" not in text)


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, model, extra, cause",
    [
        ("zero_autotp.py", "tiny", [], "zero_block_unread"),
        ("pipeline_tp.py", "tiny", [], None),
        ("hf_tp_plan.py", "tiny", [], None),
        ("moves_first.py", "internlm2_tiny", ["script.fix=[restore_buffers]"], "kernel_injection_without_policy"),
    ],
)
def test_users_scripts_at_tp_1_and_2(tmp_path, cache_dir, script, model, extra, cause):
    write_script(tmp_path, script, model_dir(cache_dir, f"model={model}"))
    run_dsexp(["-m", f"script.path={script}", "tp=1,2", *extra, "hydra.sweep.dir=s"], tmp_path, cache_dir)
    results = sorted(sweep_results(tmp_path / "s"), key=lambda r: r["config"]["tp"])
    for res in results:
        assert res["status"] == "ok", res.get("failure")
        if cause:
            assert cause in codes(res)
    two = results[1]
    assert two["correctness"]["passed"], two["correctness"]
    if script in ("zero_autotp.py", "pipeline_tp.py", "hf_tp_plan.py"):  # sharded by the engine
        assert (
            max(weights_per_rank(two) if "init" in two["ranks"][0]["phases"] else [0])
            < max(weights_per_rank(results[0]) if "init" in results[0]["ranks"][0]["phases"] else [1])
            or script == "hf_tp_plan.py"
        )


@pytest.mark.slow
def test_published_code_on_todays_transformers_is_named_and_fixed(tmp_path, cache_dir):
    """InternLM2's code computes its rotary tables in __init__ only; transformers 5 leaves them uninitialised, so the
    script as written generates from NaN: recorded as incorrect, the cause named; restore_buffers makes it correct."""
    write_script(tmp_path, "moves_first.py", model_dir(cache_dir, "model=internlm2_tiny"))
    run_dsexp(["-m", "script.path=moves_first.py", "tp=2", "script.fix=[],[restore_buffers]", "hydra.sweep.dir=s"],
              tmp_path, cache_dir)  # fmt: skip
    results = by_fix(sweep_results(tmp_path / "s"))
    as_written, fixed = results[()], results[("restore_buffers",)]
    assert as_written["failure"]["cause"] == "incorrect_output"
    assert "buffers_uninitialised" in codes(as_written)
    assert fixed["status"] == "ok" and fixed["correctness"]["passed"]


@pytest.mark.slow
def test_a_device_map_script_is_fixed(tmp_path, cache_dir):
    write_script(tmp_path, "device_map.py", model_dir(cache_dir, "model=tiny"))
    run_dsexp(["-m", "script.path=device_map.py", "tp=2", "script.fix=[],[host_load]", "hydra.sweep.dir=s"],
              tmp_path, cache_dir)  # fmt: skip
    results = by_fix(sweep_results(tmp_path / "s"))
    fixed = results[("host_load",)]
    assert fixed["status"] == "ok" and fixed["correctness"]["passed"]
    assert any(
        "device_map='auto' dropped" in str(x) for x in fixed["ranks"][0]["script"]["fixes"]["applied"]["host_load"]
    )


def test_host_load_takes_every_move_to_a_gpu():
    """`.cuda()` with no argument goes to the current GPU: host_load skips it as it skips `.to("cuda")`, `.to(0)`."""
    from dsexp.rank.workloads.script.fixes import moves_to_gpu

    assert moves_to_gpu({"method": "cuda", "target": []}) and moves_to_gpu({"method": "cuda", "target": [1]})
    assert moves_to_gpu({"method": "to", "target": ["cuda:1"]}) and moves_to_gpu({"method": "to", "target": [0]})
    assert not moves_to_gpu({"method": "to", "target": ["cpu"]}) and not moves_to_gpu({"method": "to", "target": []})


def test_a_script_run_from_another_machine_is_predicted_from_the_config_it_recorded():
    """The H200 run of the seed's main.py, fixed, at tp=4: its model folder is not here; the memory model rebuilds
    the model from the config recorded at the load and predicts each rank's weights to the byte."""
    from dsexp.analysis.memory import predict
    from dsexp.core.result import JobRecord, Phase

    from helpers.run import ROOT

    result = json.loads((ROOT / "results/h200/scripts/seed20_tp4/0/result.json").read_text())
    assert not Path(result["ranks"][0]["script"]["calls"][0]["source"]).exists()
    measured = [rk.phase(Phase.INIT).weights_device for rk in JobRecord.of(result).ranks]
    assert predict(result).weights == measured and len(measured) == 4


def test_the_diagnosis_says_what_the_script_called_with_which_arguments_and_where_the_weights_went():
    calls = [
        {"kind": "load", "api": "AutoModelForCausalLM.from_pretrained", "kwargs": {"torch_dtype": "torch.bfloat16"},
         "placement_after": {"by_device": {"cpu": 3 * 2**20}}},
        {"kind": "init", "api": "deepspeed.init_inference",
         "given": {"mp_size": 2, "replace_with_kernel_inject": False},
         "placement_after": {"by_device": {"cpu": 2**20, "cuda:0": 2**21}}},
        {"kind": "generate", "api": "LlamaForCausalLM.generate", "kwargs": {"max_new_tokens": 8}, "new_tokens": 8},
    ]  # fmt: skip
    result = {"config": {"script": {"path": "main.py"}}, "ranks": [{"rank": 0, "script": {"calls": calls}}]}
    assert what_it_did(result) == (
        "AutoModelForCausalLM.from_pretrained(torch_dtype=torch.bfloat16) -> parameters 3.00 MiB on cpu; "
        "deepspeed.init_inference(mp_size=2, replace_with_kernel_inject=False) -> parameters 1.00 MiB on cpu, "
        "2.00 MiB on cuda:0; LlamaForCausalLM.generate(max_new_tokens=8) -> 8 new tokens"
    )
    assert what_it_did({"config": result["config"], "ranks": [{"rank": 0, "script": {}}]}) == ""
