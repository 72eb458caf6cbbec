"""Run a campaign: write its models, run its steps in order (each under its own time limit), copy each sweep's
compact results into the results folder, and record what ran in <results>/campaign.json.

Every step's process carries $DSEXP_CAMPAIGN and $DSEXP_COMMIT, which each job writes into its result.json
("campaign", "commit"). The sweeps themselves stay whole in the work folder (checkpoints and pickles included)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from typing import Dict, Iterable, List, Optional, Sequence, TextIO

from dsexp.campaign.spec import REPO, Campaign, Step, substitute, sweep_overrides
from dsexp.core.protocol import CAMPAIGN_ENV, COMMIT_ENV, RESULT
from dsexp.core.schema import ConfigError
from dsexp.job.run import source_commit

# What a sweep keeps in the results folder: each job's result.json (its ranks' records and series are in it), the
# sweep's report and plots, a budget search's state (budget.json: the report's budget section rebuilds from it). Not
# kept: checkpoints, logits, snapshot pickles, rank logs, traces.
CAMPAIGN_KEEP = ("*/" + RESULT, "summary.md", "summary.csv", "multirun.yaml", "plots/*.png", "budget.json")
RECORD = "campaign.json"
MODEL_TIMEOUT_S = 3600  # writing a model's random-weight checkpoint (20B shapes: about a minute on an H200 host)
GRACE_S = 30  # after SIGTERM at a step's time limit: dsexp stops its ranks, then the step is killed


def commit() -> str:
    """The commit the campaign runs at: $DSEXP_COMMIT where it is set (a copied tree whose .git may lag its files),
    else this checkout's, else "unknown"."""
    return os.environ.get(COMMIT_ENV) or source_commit() or "unknown"


def command(
    campaign: Campaign, step: Step, values: Dict[str, str], python: str = "python", add: Sequence[str] = ()
) -> List[str]:
    """The step's command line, substituted (`add`: overrides for every sweep, from the command line)."""
    if step.kind == "overrides":
        args = [*sweep_overrides(campaign, step, add), f"hydra.sweep.dir={values['WORK']}/{step.name}"]
        argv = [python, "-m", "dsexp", "-m", *args]
    elif step.kind == "pytest":
        argv = [python, "-m", "pytest", *step.args]
    else:
        argv = [python if a in ("python", "python3") and i == 0 else a for i, a in enumerate(step.args)]
    return [substitute(a, values) for a in argv]


def model_command(overrides: List[str], python: str = "python") -> List[str]:
    return [python, "-m", "dsexp.campaign.model_dir", *overrides]


def _pump(stream: TextIO, sinks: Iterable[TextIO]) -> None:
    for line in stream:
        for sink in sinks:
            sink.write(line)
            sink.flush()


def run_step(argv: List[str], env: Dict[str, str], timeout_s: float, log: Path, stdout: Optional[Path]) -> Dict:
    """Run one command from the repo root; its output goes to `log` (and here), or its stdout to `stdout`. At
    the time limit it gets SIGTERM (a dsexp sweep then stops its ranks and records the job), then SIGKILL."""
    log.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    with open(log, "a") as log_f, open(stdout or os.devnull, "w") as out_f:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT if stdout is None else subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: the time limit reaches the whole step
        )
        pumps = [threading.Thread(target=_pump, args=(proc.stdout, [out_f] if stdout else [log_f, sys.stdout]))]
        if stdout is not None:
            pumps.append(threading.Thread(target=_pump, args=(proc.stderr, [log_f, sys.stdout])))
        for t in pumps:
            t.start()
        timed_out = interrupted = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            _stop(proc)
        except KeyboardInterrupt:  # the campaign itself stopped (Ctrl-C, SIGTERM): the step is stopped as at its limit
            interrupted = True
            _stop(proc)
        for t in pumps:  # before the log closes: a pump still writing to it would die on a closed file
            t.join(timeout=10)
    outcome = {"rc": proc.returncode, "timed_out": timed_out, "wall_s": round(time.monotonic() - t0, 1)}
    return {**outcome, "interrupted": True} if interrupted else outcome


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM to the step's group (a dsexp sweep stops its ranks and records the job), SIGKILL after GRACE_S; a
    second Ctrl-C meanwhile does not leave the step running."""
    _signal_group(proc, signal.SIGTERM)
    try:
        proc.wait(timeout=GRACE_S)
    except (subprocess.TimeoutExpired, KeyboardInterrupt):
        _signal_group(proc, signal.SIGKILL)
        proc.wait()


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def collect(sweep: Path, dest: Path) -> int:
    """Copy a sweep's compact results (CAMPAIGN_KEEP) to `dest`, replacing what an earlier run left there; a sweep
    that wrote no result leaves `dest` as it was, unless it is a budget search that launched nothing (its budget.json
    is the answer: nothing fits) and `dest` holds no result to lose. Returns the number of results copied."""
    searched_only = (sweep / "budget.json").is_file() and not list(dest.glob("*/" + RESULT))
    if not list(sweep.glob("*/" + RESULT)) and not searched_only:
        return 0
    if dest.exists():
        shutil.rmtree(dest)
    for pattern in CAMPAIGN_KEEP:
        for src in sweep.glob(pattern):
            target = dest / src.relative_to(sweep)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, target)
    return len(list(dest.glob("*/" + RESULT)))


def bundle(out: Path, steps: Sequence[str], path: Path) -> List[str]:
    """A tar.gz of what these steps left in the results folder, with its campaign.json, named as in the repo (unpack
    it at the repo root): a machine that runs each command in a fresh copy of the checkout keeps neither past the
    command. A step is its folder, and the files a command step wrote beside it named after it (`$OUT/<step>.json`).
    Returns the paths it holds."""
    base = (REPO if out.resolve().is_relative_to(REPO) else out.parent).resolve()
    paths = [out / RECORD, *(out / s for s in steps), *(f for s in steps for f in sorted(out.glob(f"{s}.*")))]
    held = {str(p.resolve().relative_to(base)): p for p in paths if p.exists()}
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, p in held.items():
            tar.add(p, arcname=name)
    return list(held)


def seed(results: Path, sweep: Path) -> int:
    """Resume a step on another machine: copy its compact results (result.json files, budget.json) from the results
    folder into a sweep folder that does not exist yet. dsexp then skips the jobs already ok and a budget search goes
    on from what it measured. Returns the number of results seeded."""
    found = list(results.glob("*/" + RESULT))
    if sweep.exists() or not found:
        return 0
    for src in [*found, *results.glob("budget.json")]:
        target = sweep / src.relative_to(results)
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, target)
    return len(found)


def resume_source(results: Path, sweep: Path, campaign: str) -> Path:
    """Where a step resumes from: its folder in the results, or the same step's sweep in an earlier work folder of
    this campaign (<work root>/<campaign>/<time>/<step>, the default layout) that holds more results: an interrupted
    run seeded from the results and measured more, but its copy into the results folder can be gone (a machine that
    copies the checkout afresh for every command, as the H200 is lent: the second --resume of a session ran the
    first one's four jobs again)."""

    def count(folder: Path) -> int:
        return len(list(folder.glob("*/" + RESULT)))

    runs = sweep.parent.parent
    earlier = [d / sweep.name for d in runs.glob("*") if d != sweep.parent] if runs.name == campaign else []
    return max([results, *sorted(e for e in earlier if e.is_dir())], key=count)  # a tie keeps the results folder


def machine() -> Dict:
    """The host and its GPUs (nvidia-smi), for the record."""
    gpus: List[str] = []
    if shutil.which("nvidia-smi"):
        query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
        gpus = subprocess.run(query, capture_output=True, text=True).stdout.strip().splitlines()
    return {"host": socket.gethostname(), "gpus": gpus}


def save_record(out: Path, run: Dict) -> None:
    """Put this run into <results>/campaign.json, after every step (earlier runs stay: a --only run adds to them)."""
    path = out / RECORD
    runs = json.loads(path.read_text())["runs"] if path.is_file() else []
    runs = [r for r in runs if r.get("started") != run["started"]] + [run]
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"campaign": run["campaign"], "runs": runs}, indent=1) + "\n")


def selected(campaign: Campaign, only: Optional[List[str]]) -> List[Step]:
    unknown = sorted(set(only or []) - {s.name for s in campaign.steps})
    if unknown:
        raise ConfigError(f"campaign {campaign.name} has no steps {unknown}: {[s.name for s in campaign.steps]}")
    return [s for s in campaign.steps if not only or s.name in only]


def needed_models(campaign: Campaign, steps: List[Step]) -> Dict[str, List[str]]:
    """The models the chosen steps name ($NAME or ${NAME}): only those are written."""
    text = " ".join(a for s in steps for a in [*s.args, s.stdout or ""])
    return {n: o for n, o in campaign.models.items() if re.search(rf"\$\{{?{n}\b", text)}


def run_campaign(
    campaign: Campaign,
    out: Path,
    work: Path,
    dry_run: bool = False,
    only: Optional[List[str]] = None,
    add: Sequence[str] = (),
    resume: bool = False,
    within_s: Optional[float] = None,
    min_step_s: float = 120.0,
) -> int:
    """Run (or with dry_run, print) the campaign. Returns 0 if every step exited 0 in time, else 1; 130 if it was
    stopped. `resume`: each sweep starts from the results folder's records of it (seed). `within_s`: the campaign
    ends that many seconds after it starts (a machine held for a call of limited length): a step is not started with
    less than `min_step_s` left, and a running one is stopped at the end as at its own limit, its results copied;
    --resume goes on from there."""
    end = None if within_s is None else time.monotonic() + within_s
    steps = selected(campaign, only)
    if campaign.frozen and not dry_run:
        raise ConfigError(f"campaign {campaign.name} cannot be remade: {campaign.frozen}")
    sha = commit()
    values = {**os.environ, "OUT": str(out), "WORK": str(work), "REPO": str(REPO)}
    env = {**os.environ, **campaign.env, CAMPAIGN_ENV: campaign.name, COMMIT_ENV: sha}
    python = "python" if dry_run else sys.executable
    print(f"# campaign {campaign.name} at {sha}: {campaign.results} -> {out} (work: {work})", flush=True)
    if dry_run and campaign.env:
        print("export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in campaign.env.items()))
    for name, overrides in needed_models(campaign, steps).items():
        argv = model_command([substitute(o, values) for o in overrides], python)
        print(f"# model {name} (its folder is ${name})\n{shlex.join(argv)}", flush=True)
        if not dry_run:
            proc = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=MODEL_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"model {name}: {proc.stderr[-2000:]}")
            values[name] = proc.stdout.strip().splitlines()[-1]
        else:
            values[name] = f"<{name}>"
    record = {"campaign": campaign.name, "commit": sha, "started": time.time(), "machine": machine(), "steps": []}
    failed = False
    for step in steps:
        argv = command(campaign, step, values, python, add)
        stdout = Path(substitute(step.stdout, values)) if step.stdout else None
        where = f" -> {out / step.name}" if step.kind == "overrides" else f" > {stdout}" if stdout else ""
        print(f"# step {step.name} ({step.kind}, at most {step.timeout_s} s){where}", flush=True)
        print(shlex.join(argv) + (f" > {shlex.quote(str(stdout))}" if stdout else ""), flush=True)
        if dry_run:
            continue
        if stdout:
            stdout.parent.mkdir(parents=True, exist_ok=True)
        limit = step.timeout_s if end is None else min(step.timeout_s, end - time.monotonic())
        if limit < min(min_step_s, step.timeout_s):
            print(
                f"# step {step.name}: not started, {max(limit, 0):.0f} s left of --within; --resume goes on", flush=True
            )
            return 130
        if resume and step.kind == "overrides":
            source = resume_source(out / step.name, work / step.name, campaign.name)
            seeded = seed(source, work / step.name)
            print(f"# step {step.name}: resumed from {seeded} results in {source}", flush=True)
        outcome = run_step(argv, {**env, **step.env}, limit, work / f"{step.name}.log", stdout)
        if outcome["timed_out"] and limit < step.timeout_s:
            outcome = {**outcome, "timed_out": False, "interrupted": True, "within": True}
        if step.kind == "overrides":
            outcome["results"] = collect(work / step.name, out / step.name)
        failed |= outcome["rc"] != 0 or outcome["timed_out"]
        shown = ["python" if i == 0 and a == python else a for i, a in enumerate(argv)]
        record["steps"].append({"name": step.name, "command": shlex.join(shown), **outcome})
        print(f"# step {step.name}: {json.dumps(outcome)}", flush=True)
        save_record(out, record)
        if outcome.get("interrupted"):
            # what the step measured is copied and recorded above: nothing is lost, and a budget search resumes
            why = "--within's end" if outcome.get("within") else "interrupted"
            print(f"# campaign stopped in step {step.name} ({why}); run it again with --resume to go on", flush=True)
            return 130
    return int(failed)
