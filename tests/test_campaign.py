"""Campaigns (campaigns/<name>.yaml, python -m dsexp.campaign): every file parses and every sweep of it composes
against dsexp's config, every results folder under results/h200/ is remade by exactly one campaign, the dry run
prints the commands, and a campaign run end to end records its name and commit in each result."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

from dsexp.campaign import runner as crun
from dsexp.campaign.__main__ import main
from dsexp.campaign.spec import Campaign, Step, load, names, parse, substitute, sweep_overrides
from dsexp.core.schema import ConfigError
from dsexp.job.run import source_commit

from helpers.run import CONF, ROOT

CAMPAIGNS = [load(n) for n in names()]


def test_there_is_a_campaign_for_each_gpu_section():
    assert {"shared", "trims", "scripts", "stacks", "published", "example", "matrix", "cpu_smoke"} <= set(names())


def expanded(overrides):
    """Every job of a sweep: Hydra's own split of `a=1,2 b=x,y` into its combinations."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    parsed = OverridesParser.create().parse_overrides(overrides)
    return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]


def test_hydra_split_sees_every_combination():
    assert sorted(map(tuple, expanded(["tp=1,2", "load=eager,meta", "model=tiny"]))) == [
        ("tp=1", "load=eager", "model=tiny"),
        ("tp=1", "load=meta", "model=tiny"),
        ("tp=2", "load=eager", "model=tiny"),
        ("tp=2", "load=meta", "model=tiny"),
    ]


def test_every_sweep_of_every_campaign_composes(tmp_path):
    """Each job a campaign's sweeps would run, composed (nothing run) into dsexp's schema: a typo in a key, a group
    option that does not exist or a value of the wrong type fails here, not on the GPU machine."""
    from hydra import compose, initialize_config_dir

    from dsexp.compose.config import to_schema

    values = {"WORK": str(tmp_path / "work"), "OUT": str(tmp_path / "out"), "REPO": str(ROOT)}
    composed = set()  # a job several campaigns run alike (the same overrides) is composed once
    models = set()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for c in CAMPAIGNS:
            names_ = {**values, **{m: f"/models/{m}" for m in c.models}}
            for s in (s for s in c.steps if s.kind == "overrides"):
                for job in expanded([substitute(o, names_) for o in sweep_overrides(c, s)]):
                    if tuple(job) in composed:
                        continue
                    spec = to_schema(compose("config", overrides=job, return_hydra_config=True))
                    assert spec.tp >= 1, (c.name, s.name, job)
                    composed.add(tuple(job))
            for overrides in c.models.values():
                if tuple(overrides) not in models:
                    assert to_schema(compose("config", overrides=overrides)).model.name, (c.name, overrides)
                    models.add(tuple(overrides))
    assert len(composed) > 60


def test_every_results_folder_under_h200_is_remade_by_exactly_one_campaign():
    named = [c.results for c in CAMPAIGNS]
    for entry in sorted((ROOT / "results" / "h200").iterdir()):
        rel = str(entry.relative_to(ROOT))
        assert named.count(rel) == 1, f"{rel} is named by {named.count(rel)} campaigns"
    assert all(c.findings and c.machine for c in CAMPAIGNS)


def test_files_and_modules_a_campaign_names_exist():
    for c in CAMPAIGNS:
        for s in c.steps:
            args = s.args[1:] if s.kind == "command" else s.args
            for a in args:
                if a.startswith(("benchmarks/", "scripts/", "tests/", "examples/")):
                    assert (ROOT / a).exists(), (c.name, s.name, a)
            if s.kind == "command" and s.args[:2] == ["python", "-m"]:
                import importlib.util

                assert importlib.util.find_spec(s.args[2]) is not None, (c.name, s.args[2])


def test_a_step_overrides_the_common_key_it_sets():
    c = load("shared")
    zero3 = next(s for s in c.steps if s.name == "zero3")
    got = sweep_overrides(c, zero3)
    assert "generate.new_tokens=2" in got and "generate.new_tokens=8" not in got
    assert "timeout_s=480" in got and "timeout_s=300" not in got and "model=internlm2_20b_shapes" in got
    slurm = sweep_overrides(c, zero3, add=["hydra/launcher=dsexp_slurm", "timeout_s=900"])
    assert slurm[-2:] == ["hydra/launcher=dsexp_slurm", "timeout_s=900"] and "timeout_s=480" not in slurm


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"name": "a", "overrides": ["tp=1"], "command": ["ls"], "timeout_s": 5}, "exactly one of"),
        ({"name": "a", "overrides": ["tp=1"]}, "timeout_s"),
        ({"name": "a b", "overrides": ["tp=1"], "timeout_s": 5}, "a name of"),
        ({"name": "a", "overrides": ["tp=1"], "timeout_s": 5, "budget": 9}, "unknown keys"),
    ],
)
def test_a_bad_step_is_refused_naming_it(raw, message):
    base = {"about": "x", "machine": "cpu", "results": "results/x", "findings": ["none"]}
    with pytest.raises(ConfigError, match=message):
        parse("bad", {**base, "steps": [raw]})


def test_a_campaign_outside_results_or_unknown_is_refused():
    with pytest.raises(ConfigError, match="under results/"):
        parse(
            "bad",
            {"about": "x", "machine": "m", "results": "/tmp/x", "findings": ["f"], "steps": []}
            | {"steps": [{"name": "a", "command": ["ls"], "timeout_s": 1}]},
        )
    with pytest.raises(ConfigError, match="no campaign 'nope'"):
        load("nope")


def test_substitution_leaves_hydra_interpolations_alone():
    assert substitute("a=$WORK/x b=${oc.env:HOME} $UNKNOWN", {"WORK": "/w"}) == "a=/w/x b=${oc.env:HOME} $UNKNOWN"


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path, capsys):
    assert main(["cpu_smoke", "--dry-run", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "w")]) == 0
    lines = capsys.readouterr().out.splitlines()
    sweep = "python -m dsexp -m model=tiny tp=1 generate.new_tokens=2 check.correctness=false hydra.sweep.dir="
    sweep += f"{tmp_path}/w/tiny"
    assert sweep in lines
    assert not (tmp_path / "out").exists() and not (tmp_path / "w").exists()


def test_dry_run_of_a_campaign_with_models_and_steps_of_every_kind(tmp_path, capsys):
    only = ["--only", "write_seed20,seed20"]
    assert main(["scripts", "--dry-run", "--out", str(tmp_path / "o"), "--work", "/w", *only]) == 0
    out = capsys.readouterr().out
    assert "# model D20 (its folder is $D20)\npython -m dsexp.campaign.model_dir model=internlm2_20b_shapes\n" in out
    assert "num_hidden_layers=24" not in out  # D24: only the steps left out name it
    assert "python tests/helpers/user_scripts.py /w/seed20_main main.py '<D20>'" in out
    assert "script.path=/w/seed20_main/main.py tp=2 'script.fix=[all],[]' launcher=deepspeed stack=seed" in out
    assert "export USE_FLAX=0" in out and "write_seed24" not in out
    assert main(["tests", "--dry-run", "--out", "/o"]) == 0
    pytest = "python -m pytest -m gpu -p no:cacheprovider -q -rA --junitxml=/o/gpu_tests.xml tests > /o/gpu_tests.txt"
    assert pytest in capsys.readouterr().out


def test_a_frozen_campaign_only_dry_runs(tmp_path):
    with pytest.raises(ConfigError, match="cannot be remade"):
        crun.run_campaign(load("published_before_fix"), tmp_path / "o", tmp_path / "w")
    assert main(["published_before_fix", "--dry-run"]) == 0


def test_collect_keeps_the_compact_results_only(tmp_path):
    sweep, dest = tmp_path / "sweep", tmp_path / "dest"
    for f in ("0/result.json", "0/ranks/rank0.json", "0/ranks/snapshots/r0.pickle", "0/reference/logits.pt",
              "summary.md", "plots/memory_00.png", "0/.dsexp/attempts/1/result.json"):  # fmt: skip
        (sweep / f).parent.mkdir(parents=True, exist_ok=True)
        (sweep / f).write_text("{}")
    (dest / "old").mkdir(parents=True)
    assert crun.collect(sweep, dest) == 1
    assert sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) == [
        "0/result.json",
        "plots/memory_00.png",
        "summary.md",
    ]
    assert crun.collect(tmp_path / "empty", dest) == 0 and (dest / "0" / "result.json").is_file()


def test_a_budget_search_that_launched_nothing_is_kept_but_never_over_results(tmp_path):
    sweep, dest = tmp_path / "sweep", tmp_path / "dest"
    sweep.mkdir()
    (sweep / "budget.json").write_text('{"configs": []}')
    (sweep / "summary.md").write_text("nothing fits")
    assert crun.collect(sweep, dest) == 0
    assert (dest / "budget.json").is_file() and (dest / "summary.md").read_text() == "nothing fits"
    (dest / "0").mkdir()
    (dest / "0" / "result.json").write_text("{}")
    assert crun.collect(sweep, dest) == 0 and (dest / "0" / "result.json").is_file()


def test_a_step_past_its_time_limit_is_stopped(tmp_path):
    t0 = time.monotonic()
    out = crun.run_step(["sleep", "30"], dict(os.environ), 1, tmp_path / "s.log", None)
    assert out["timed_out"] and out["rc"] != 0 and time.monotonic() - t0 < 10


@pytest.mark.slow  # ~65 s idle; the default suite checks the same provenance on the job's side (below)
def test_a_campaign_run_records_its_name_and_commit_in_each_result(tmp_path, cache_dir):
    """cpu_smoke end to end, as a user runs it: one tiny tp=1 job, its compact results in the results folder."""
    env = {**os.environ, "DSEXP_CACHE": str(cache_dir), "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, "-m", "dsexp.campaign", "cpu_smoke", "--out", str(out), "--work", str(work)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((out / "tiny" / "0" / "result.json").read_text())
    assert result["status"] == "ok" and result["campaign"] == "cpu_smoke"
    sha = result["commit"].split("-")[0]  # "-dirty" follows the tree's state when the runner started
    assert sha == source_commit().split("-")[0] and len(sha) == 40
    assert not (out / "tiny" / "0" / "ranks").exists() and (work / "tiny" / "0" / "ranks").is_dir()
    record = json.loads((out / "campaign.json").read_text())
    (step,) = record["runs"][0]["steps"]
    assert record["runs"][0]["commit"] == result["commit"] and step["rc"] == 0 and step["results"] == 1
    assert step["command"].startswith("python -m dsexp -m model=tiny tp=1 ")


def test_every_benchmark_runs_from_a_make_target():
    targets = subprocess.run(["make", "-s", "-n", "benchmark", "NAME=packing", "ARGS=--jobs 2"], cwd=ROOT,
                             capture_output=True, text=True, env={**os.environ, "USE_VENV": "0"})  # fmt: skip
    assert "python3 benchmarks/packing.py --jobs 2" in targets.stdout
    listed = subprocess.run(["make", "-s", "benchmark", "USE_VENV=0"], cwd=ROOT, capture_output=True, text=True)
    shared = {"common"}  # what the benchmarks share (benchmarks/common.py), no benchmark of its own
    assert sorted(listed.stdout.split()) == sorted(
        p.stem for p in (ROOT / "benchmarks").glob("*.py") if p.stem not in shared
    )


def test_scripts_keep_only_the_offline_machine_and_findings():
    """GPU sweeps are campaigns and measurements benchmarks: scripts/ holds FINDINGS' builder and the offline
    machine's set-up, under half of its 1,979 lines before campaigns."""
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "scripts").rglob("*") if p.is_file())
    assert files == ["scripts/gpu/env.sh", "scripts/make_findings.py"]
    assert sum(len((ROOT / f).read_text().splitlines()) for f in files) < 1979 / 2


def test_a_command_step_runs_with_the_campaigns_python():
    c = Campaign("x", "a", "m", "results/x", ["f"], [Step("s", "command", ["python", "-c", "pass"], 5)])
    assert crun.command(c, c.steps[0], {"WORK": "/w"}, python="PY") == ["PY", "-c", "pass"]


def test_a_jobs_provenance_is_the_campaign_and_commit_it_was_given_else_its_checkout(monkeypatch):
    """What every result.json records as `campaign` and `commit` (dsexp.job.run.provenance)."""
    from dsexp.core.protocol import CAMPAIGN_ENV, COMMIT_ENV
    from dsexp.job.run import provenance, source_commit

    monkeypatch.setenv(CAMPAIGN_ENV, "capacity")
    monkeypatch.setenv(COMMIT_ENV, "abc123")
    assert provenance() == {"campaign": "capacity", "commit": "abc123"}
    monkeypatch.delenv(CAMPAIGN_ENV)
    monkeypatch.delenv(COMMIT_ENV)
    here = source_commit()
    assert provenance() == ({"commit": here} if here else {})
    assert here is None or re.fullmatch(r"[0-9a-f]{40}(-dirty)?", here)


def test_a_campaign_stopped_mid_step_copies_what_the_step_measured_and_says_how_to_resume(tmp_path, monkeypatch):
    """The H200: `timeout -s INT` stopped a campaign during a budget step; the step's jobs were in the work folder
    but never copied to the results folder, and a pump thread died on the closed log. Now the step is stopped, its
    results copied and recorded, and the next steps are not run."""
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "a" / "0").mkdir(parents=True)
    (work / "a" / "0" / "result.json").write_text("{}")
    calls = []

    def interrupted_step(argv, env, timeout_s, log, stdout):
        calls.append(argv)
        return {"rc": -15, "timed_out": False, "wall_s": 1.0, "interrupted": True}

    monkeypatch.setattr(crun, "run_step", interrupted_step)
    campaign = Campaign("t", "a", "m", str(out), [], [Step(n, "overrides", ["model=tiny"], 5) for n in "ab"])
    assert crun.run_campaign(campaign, out, work) == 130
    assert len(calls) == 1 and (out / "a" / "0" / "result.json").is_file()
    (step,) = json.loads((out / "campaign.json").read_text())["runs"][0]["steps"]
    assert step["interrupted"] and step["results"] == 1


def test_a_stopped_campaign_bundles_its_steps_records_and_campaign_json_for_a_machine_that_forgets(
    tmp_path, monkeypatch
):
    """The H200 runs each command in a fresh copy of the checkout: what a campaign wrote into the results folder is
    gone at the next command. --bundle packs the chosen steps' compact results and campaign.json, named as in the
    results' parent, even when the campaign was stopped (a command step's file named after it too); another step's
    folder and file stay out."""
    import tarfile

    from dsexp.campaign import __main__ as cmain

    work, out = tmp_path / "work", tmp_path / "results" / "budget"
    (work / "a" / "0").mkdir(parents=True)
    (work / "a" / "0" / "result.json").write_text("{}")
    (out / "other" / "0").mkdir(parents=True)
    (out / "other" / "0" / "result.json").write_text("{}")
    (out / "a.json").write_text("{}")  # what a command step wrote into $OUT, named after the step
    (out / "other.json").write_text("{}")
    campaign = Campaign("t", "a", "m", str(out), [], [Step(n, "overrides", ["model=tiny"], 5) for n in "ab"])
    monkeypatch.setattr(cmain, "load", lambda name: campaign)
    stopped = {"rc": -15, "timed_out": False, "wall_s": 1.0, "interrupted": True}
    monkeypatch.setattr(crun, "run_step", lambda *a: stopped)
    tgz = tmp_path / "out" / "b.tgz"
    assert cmain.main(["t", "--out", str(out), "--work", str(work), "--bundle", str(tgz), "--only", "a,b"]) == 130
    with tarfile.open(tgz) as tar:
        names = tar.getnames()
    assert "budget/campaign.json" in names and "budget/a/0/result.json" in names and "budget/a.json" in names
    assert not any(n.startswith(("budget/other", "budget/b")) for n in names)


def test_within_stops_the_running_step_at_its_end_and_starts_none_after(tmp_path):
    """A machine held for a call of limited length (the device tool's 10 minutes): --within ends the campaign that
    many seconds after it starts. The first step (its own limit 60 s) is stopped at the end as at its own limit and
    recorded as stopped, not failed; the next is not started; 130 says --resume goes on."""
    out, work = tmp_path / "out", tmp_path / "work"
    steps = [Step("a", "command", ["sleep", "30"], 60), Step("b", "command", ["touch", str(tmp_path / "b")], 60)]
    t0 = time.monotonic()
    assert crun.run_campaign(Campaign("t", "a", "m", str(out), [], steps), out, work, within_s=2, min_step_s=1) == 130
    assert time.monotonic() - t0 < 40 and not (tmp_path / "b").exists()
    (step,) = json.loads((out / "campaign.json").read_text())["runs"][0]["steps"]
    assert step["name"] == "a" and step["interrupted"] and step["within"] and not step["timed_out"]


def test_within_does_not_start_a_step_with_less_than_min_step_left(tmp_path, monkeypatch, capsys):
    ran = []
    monkeypatch.setattr(crun, "run_step", lambda argv, *a: ran.append(argv) or {"rc": 0, "timed_out": False})
    out, work = tmp_path / "out", tmp_path / "work"
    steps = [Step("short", "command", ["true"], 30), Step("long", "command", ["true"], 600)]
    campaign = Campaign("t", "a", "m", str(out), [], steps)
    # 100 s left: the 30 s step runs (its whole limit fits), the 600 s one would get less than min_step's 120 s
    assert crun.run_campaign(campaign, out, work, within_s=100, min_step_s=120) == 130
    assert ran == [["true"]] and "# step long: not started, 100 s left of --within" in capsys.readouterr().out
    assert crun.run_campaign(campaign, out, work, within_s=1000, min_step_s=120) == 0 and len(ran) == 3


def test_within_must_be_positive():
    with pytest.raises(SystemExit):
        main(["budget", "--within", "0"])


def test_ctrl_c_during_a_step_stops_it_and_returns(tmp_path):
    import _thread
    import threading

    started = tmp_path / "started"

    def interrupt_once_running():  # Ctrl-C while the step runs (not before: a loaded machine starts it late)
        deadline = time.monotonic() + 60
        while not started.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        _thread.interrupt_main()

    # a process started in the background by a non-interactive shell (make in CI) ignores SIGINT: give it Python's
    # handler for this test, as an interactive run has
    import signal

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=interrupt_once_running, daemon=True).start()
    step = [sys.executable, "-c", f"import time; open({str(started)!r}, 'w').close(); time.sleep(60)"]
    t0 = time.monotonic()
    try:
        out = crun.run_step(step, dict(os.environ), 120, tmp_path / "s.log", None)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert out["interrupted"] and not out["timed_out"] and out["rc"] != 0 and time.monotonic() - t0 < 45


def test_resume_seeds_a_new_work_folder_from_the_results_folder_and_never_overwrites_one(tmp_path, monkeypatch):
    """A budget step cut short on a GPU machine that is gone: --resume copies its committed records (result.json,
    budget.json) into the new work folder, so dsexp skips what ran and the search goes on; an existing work
    folder is left as it is."""
    results, work = tmp_path / "results", tmp_path / "work"
    for f in ("gpu24/0/result.json", "gpu24/1/result.json", "gpu24/budget.json", "gpu24/summary.md"):
        (results / f).parent.mkdir(parents=True, exist_ok=True)
        (results / f).write_text("{}")
    assert crun.seed(results / "gpu24", work / "gpu24") == 2
    assert sorted(str(p.relative_to(work)) for p in work.rglob("*") if p.is_file()) == [
        "gpu24/0/result.json", "gpu24/1/result.json", "gpu24/budget.json"]  # fmt: skip
    assert crun.seed(results / "gpu24", work / "gpu24") == 0  # already there: untouched
    seen = []
    monkeypatch.setattr(crun, "run_step", lambda argv, *a: seen.append(argv) or {"rc": 0, "timed_out": False})
    campaign = Campaign("t", "a", "m", str(results), [], [Step("gpu24", "overrides", ["model=tiny"], 5)])
    assert crun.run_campaign(campaign, results, tmp_path / "fresh", resume=True) == 0
    assert (tmp_path / "fresh" / "gpu24" / "budget.json").is_file() and seen


def test_resume_takes_an_earlier_work_folder_that_measured_more_than_the_results_folder_holds(tmp_path):
    """The H200, 2026-12-02: each command ran in a fresh copy of the checkout, so the results folder an interrupted
    budget step had filled was gone at the next command, while the campaign's work folder under /tmp stayed; the
    second --resume started from the committed records and ran four jobs again. It now resumes from the fuller."""
    results = tmp_path / "results" / "gpu40"
    root = tmp_path / "campaigns" / "budget"
    for f in ("results/gpu40/0/result.json", "campaigns/budget/t1/gpu40/0/result.json",
              "campaigns/budget/t1/gpu40/1/result.json", "campaigns/budget/t1/gpu40/budget.json",
              "campaigns/budget/t1/other/0/result.json", "campaigns/budget/t1/other/1/result.json",
              "campaigns/budget/t1/other/2/result.json"):  # fmt: skip
        (tmp_path / f).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / f).write_text("{}")
    assert crun.resume_source(results, root / "t2" / "gpu40", "budget") == root / "t1" / "gpu40"
    assert crun.seed(root / "t1" / "gpu40", root / "t2" / "gpu40") == 2
    # the results folder where it holds as many; an explicit --work outside <root>/<campaign>/ looks nowhere else
    assert crun.resume_source(results, tmp_path / "w" / "gpu40", "budget") == results
    assert crun.resume_source(results, root / "t3" / "fresh", "budget") == results
