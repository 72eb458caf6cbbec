"""A user's script gets exactly the arguments it was given (issue 46): the launcher runs dsexp's entry
(dsexp.rank.workloads.script.entry), which reads the script and its arguments from the job file, so the launcher's
argparse never reads `--n` or `--max` as abbreviations of its own options; the script sees the sys.argv `torchrun
script.py ARGS` or `deepspeed script.py ARGS` would give it, and the probes still start in its ranks."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException

from dsexp.core.protocol import SCRIPT_ENTRY_MODULE
from dsexp.core.schema import ConfigError
from dsexp.job.launch import rank_command
from dsexp.rank.workloads.script.entry import script_argv

from helpers.run import compose, run_dsexp, spec_of

SCRIPT = Path(__file__).parent / "data" / "user_scripts" / "launcher_prefixes.py"
ARGS = ["--n", "3", "--max", "7", "--node", "two words", "--master=x=y", "parsed"]


@pytest.mark.parametrize(
    "launcher", ["torchrun", pytest.param("deepspeed", marks=pytest.mark.slow)]
)  # 9-14 s and 15-26 s on 2 cores: the runner, launch.py and each rank import DeepSpeed
def test_options_the_launcher_has_too_reach_the_script(tmp_path, cache_dir, launcher):
    """`--n`, `--max`, `--node`, `--master` begin as torchrun's and DeepSpeed's own options do (argparse took them for
    abbreviations of those and the launcher stopped, 2026-12-03)."""
    args = ",".join(f"'{a}'" for a in ARGS)
    run_dsexp([f"script.path={SCRIPT}", f"script.args=[{args}]", "tp=2", f"launcher={launcher}",
               "check.correctness=false", "tracking.uri=none", "hydra.run.dir=one"], tmp_path, cache_dir)  # fmt: skip
    result = json.loads((tmp_path / "one" / "result.json").read_text())
    assert result["status"] == "ok", result.get("failure")
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"parsed.rank{rank}.json").read_text())
        local_rank = [f"--local_rank={rank}"] if launcher == "deepspeed" else []  # where DeepSpeed's launch.py puts it
        assert seen["argv"] == [str(SCRIPT), *local_rank, *ARGS]
        assert seen["args"] == {"n": 3, "max": 7, "node": "two words", "master": "x=y", "out": "parsed",
                                "local_rank": rank if local_rank else None}  # fmt: skip
        # run as `python script.py` runs it: __main__, its own file, its folder first on sys.path
        assert (seen["name"], seen["file"], seen["path0"]) == ("__main__", str(SCRIPT), str(SCRIPT.parent))
        record = result["ranks"][rank]
        assert record["argv"] == seen["argv"]  # the probes started in the script's rank, after argv was restored
    printed = result["ranks"][0]["script"]["events"]  # the hooks caught the script's own see_memory_usage
    assert [e["message"] for e in printed if e["kind"] == "see_memory_usage"] == ["parsed --n 3"]


def test_the_launcher_is_handed_dsexps_entry_and_never_the_scripts_arguments(tmp_path):
    script = {"path": str(SCRIPT), "argv": ARGS}
    torchrun = rank_command(spec_of(f"script.path={SCRIPT}", "tp=2"), tmp_path, None, script)
    assert torchrun[-3:] == ["-m", SCRIPT_ENTRY_MODULE, str(tmp_path)] and "--n" not in torchrun
    deepspeed = rank_command(spec_of(f"script.path={SCRIPT}", "tp=2", "launcher=deepspeed"), tmp_path, 1234, script)
    assert deepspeed[-3:] == ["--module", SCRIPT_ENTRY_MODULE, str(tmp_path)] and "--no_local_rank" not in deepspeed
    quiet = spec_of(f"script.path={SCRIPT}", "tp=2", "launcher=deepspeed", "script.local_rank_arg=false")
    assert rank_command(quiet, tmp_path, 1234, script)[-4] == "--no_local_rank"


def test_the_entry_keeps_what_the_launcher_added_where_it_put_it():
    assert script_argv(["entry.py", "/job"], "/job", "s.py", ["--n", "1"]) == ["s.py", "--n", "1"]
    before = script_argv(["entry.py", "--local_rank=1", "/job"], "/job", "s.py", ["--n"])
    assert before == ["s.py", "--local_rank=1", "--n"]
    assert script_argv(["entry.py", "/job", "--local_rank=1"], "/job", "s.py", []) == ["s.py", "--local_rank=1"]


def test_a_script_argument_hydra_cannot_pass_as_a_string_is_refused_with_the_key():
    """A list or a mapping is no command-line argument; null is refused by the schema (List[str]) while Hydra
        composes; a boolean too (unquoted, Hydra reads true as one, and the script would get "True"). A value quoted
    passes as written."""
    for bad, shown in (("[a,b]", "['a', 'b']"), ("{a: 1}", "{'a': 1}")):
        with pytest.raises(ConfigError, match=re.escape(f"script.args[1]={shown}: each argument must be a string")):
            spec_of(f"script.path={SCRIPT}", f"script.args=[--n,{bad}]")
    with pytest.raises(ConfigCompositionException, match=r"script\.args=\[null\]"):
        compose([f"script.path={SCRIPT}", "script.args=[null]"])
    quoted = spec_of(f"script.path={SCRIPT}", "script.args=[--max,'1.50',--flag,'true','']")
    assert quoted.script.args == ["--max", "1.50", "--flag", "true", ""]
