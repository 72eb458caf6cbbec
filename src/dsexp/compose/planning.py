"""`python -m dsexp.plan [-m] <overrides> [--json FILE] [--markdown FILE]`: every configuration the same overrides
would run, predicted from the config alone, without launching anything or reading a weight.

The config is composed by Hydra as `python -m dsexp` composes it (experiment presets, config groups, `-m` sweeps and
lists); each configuration is checked for sense (dsexp.compose.validate.validate_plan: not against this machine) and
predicted by dsexp.predict.job, the function the budget search and the report call. A configuration the model has
no rule for is listed with its reason, and so is one whose engine's own init refuses the model (DeepSpeed's AutoTP,
run on the meta device as each rank: dsexp.engines.init_inference.placement.init_fails); bad input is refused
before anything is predicted, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from dsexp.compose.config import compose_app, config_error, to_schema
from dsexp.core.schema import ConfigError, JobConfig

GIB = 2**30


class PlanError(Exception):
    """Bad input: named with the key and what is accepted."""


@dataclass
class Planned:
    overrides: List[str]  # the combination's own overrides (what the sweep varies)
    spec: JobConfig
    combo: List[str]  # every override that composes it (for a plan of it alone, in its stack)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m dsexp.plan",
        description="Predict per-GPU and host memory of every configuration the overrides compose, from the config "
        "alone (no GPU, no ranks, no weights read).",
    )
    p.add_argument("-m", "--multirun", action="store_true", help="expand sweeps (tp=1,2,4) as `python -m dsexp -m`")
    p.add_argument("--json", type=Path, help="write the predictions (bytes) to this file")
    p.add_argument("--markdown", type=Path, help="write the report's plan section to this file")
    p.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="the largest batch from the allocated bytes alone (a bound: fragmentation only lowers it), without "
        "replaying each point's generate calls through the caching allocator (the default, with a GPU size)",
    )
    p.add_argument("--replay", action="store_true", default=True, help="the default; kept so that old commands run")
    p.add_argument(
        "--trace-in-stack",
        action="store_true",
        help="where a configuration's stack pins another transformers than this environment's, trace the replay's "
        "generate under that version (the overlay a sweep prepares for the ranks, built once under cache_dir: "
        "the package index is needed the first time); the frees the replay sees are transformers' own",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m dsexp")
    args = p.parse_intermixed_args(list(argv))  # `-m` anywhere among the overrides, as `python -m dsexp` takes it
    if args.trace_in_stack and not args.replay:
        p.error("--trace-in-stack traces the replay's generate: drop --no-replay")
    return args


def combinations(overrides: Sequence[str], multirun: bool) -> Tuple[List[List[str]], Set[str]]:
    """(The override lists Hydra's basic sweeper would run, the keys its sweeps vary): the command line's and an
    experiment preset's sweeps; each list has the values the sweeps chose first."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException
    from omegaconf import OmegaConf

    parser = OverridesParser.create()
    try:
        parsed = parser.parse_overrides(list(overrides))
    except HydraException as e:
        raise PlanError(config_error(e)) from None
    sweeps = [o.input_line for o in parsed if o.is_sweep_override()]
    if sweeps and not multirun:
        raise PlanError(f"{', '.join(sweeps)}: a sweep; add -m (as for python -m dsexp -m)")
    fixed = [o.input_line for o in parsed if not o.is_sweep_override()]
    params = OmegaConf.select(composed(fixed, hydra=True), "hydra.sweeper.params") or {}
    args = parser.parse_overrides([f"{k}={v}" for k, v in params.items()] + list(overrides))
    swept = {o.key_or_group for o in args if o.is_sweep_override()}
    return [
        sorted(combo, key=lambda o: o.split("=", 1)[0].lstrip("+~") not in swept)
        for batch in BasicSweeper.split_arguments(args, None)
        for combo in batch
    ], swept


def checked(combo: List[str]) -> JobConfig:
    """One combination composed and checked for sense, or PlanError naming the key."""
    from dsexp.compose.validate import validate_plan

    try:
        return validate_plan(to_schema(composed(combo)))
    except ConfigError as e:
        raise PlanError(config_error(e)) from None


def composed(overrides: Sequence[str], hydra: bool = False):
    """The config these overrides compose, or PlanError naming the key (and a group's options)."""
    from hydra.errors import HydraException, MissingConfigException

    try:
        return compose_app(overrides, hydra)
    except MissingConfigException as e:
        msg = config_error(e) + (f"; choose one of: {', '.join(sorted(e.options))}" if e.options else "")
        raise PlanError(msg) from None
    except HydraException as e:
        raise PlanError(config_error(e)) from None


def space(overrides: Sequence[str], multirun: bool) -> List[Planned]:
    """Every configuration, each checked, before any is predicted: the first bad one stops the plan."""
    combos, swept = combinations(overrides, multirun)
    return [Planned([o for o in c if o.split("=", 1)[0].lstrip("+~") in swept], checked(c), c) for c in combos]


def plan_one(p: Planned, replay: bool = True, in_stack: bool = False) -> Dict[str, Any]:
    """One configuration's entry: its prediction (dsexp.predict.job.plan_entry; the largest batch the allocator
    replay's unless not `replay`), or why it has none. `in_stack` (with `replay`): planned in its stack's environment
    where that pins another transformers (plan_in_stack)."""
    from dsexp.job.overlay import other_transformers

    wanted = other_transformers(p.spec.stack) if replay and in_stack else None
    if wanted:
        return plan_in_stack(p, wanted)
    from dsexp.compose.budget.model import predict_spec, script_config
    from dsexp.engines.placement import RULES
    from dsexp.predict import job as model

    config = script_config(p.spec)
    head = head_of(p)
    gib = p.spec.budget.gpu_gib
    t0 = time.perf_counter()
    try:
        pred = predict_spec(p.spec, model_dir=cached_folder(p.spec))
        if pred.error:
            return {**head, "status": "not_predicted", "reason": pred.error}
        fails = model.fails_in_init(pred, config, RULES)
        if fails:  # the run cannot start: no memory to predict
            return {**head, "status": "fails_in_init", "reason": fails}
        gpu = int(gib * GIB) if gib else None
        entry = model.plan_entry(pred, config, RULES, model.workloads_of(config), gpu, replay)
    except Exception as e:  # a configuration the model has no rule for: said, the others still predicted
        return {**head, "status": "not_predicted", "reason": f"{type(e).__name__}: {e}"}
    seconds = round(time.perf_counter() - t0, 3)
    return {
        **head,
        "status": "predicted",
        "plan_seconds": seconds,
        "model_parameters": parameters(pred, config),
        **entry,
    }


def parameters(pred, config) -> int:
    """The whole model's parameters (a tied weight once), counted on its meta model."""
    from dsexp.predict.job import config_model

    return sum(t.numel() for t in config_model(pred, config).parameters())


def head_of(p: Planned) -> Dict[str, Any]:
    """What names a configuration's entry: its label (the overrides the sweep varies), model and tp."""
    label = " ".join(p.overrides) or "(as composed)"
    return {"configuration": label, "overrides": p.overrides, "model": p.spec.model.name, "tp": p.spec.tp}


def plan_in_stack(p: Planned, wanted: str) -> Dict[str, Any]:
    """The configuration planned alone (`python -m dsexp.plan --replay`) with its stack's overlay first on the path,
    as its ranks would run: the whole prediction, the generate's trace included, under the stack's transformers
    (`wanted`). The configuration's own label is kept; a plan the overlay cannot run is an entry saying why."""
    from dsexp.job.overlay import StackError, failed_tail, run_in_stack

    head = head_of(p)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "plan.json"
        try:
            proc = run_in_stack(p.spec.stack, p.spec.cache_dir, "dsexp.plan", "--replay", "--json", str(out), *p.combo)
        except StackError as e:
            return {**head, "status": "not_predicted", "reason": f"its stack could not be prepared: {e}"}
        if proc.returncode != 0 or not out.is_file():
            return {**head, "status": "not_predicted", "reason": f"its plan in the stack failed: {failed_tail(proc)}"}
        (entry,) = json.loads(out.read_text())["configurations"]
    traced = {r["traced_with"] for r in replays(entry) if r.get("traced_with")}
    if traced - {f"transformers {wanted}"}:  # the overlay did not put its transformers first
        ran = ", ".join(sorted(traced))
        return {**head, "status": "not_predicted", "reason": f"its stack's overlay traced with {ran}, not {wanted}"}
    return {**entry, **head, "in_stack": True}


def replays(entry: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The allocator replays of a plan entry, one per prompt length."""
    return [fit["replayed"] for fit in (entry.get("largest_batch") or {}).values() if fit.get("replayed")]


def cached_folder(spec: JobConfig) -> Optional[str]:
    """The preset's checkpoint where dsexp already wrote it here (its files' sizes, never their data, size the host's
    loading cost); None: sized as the writer would pack it."""
    from dsexp.job.run import checkpoint_args
    from dsexp.models.writer import cached_checkpoint

    if spec.model.path or not spec.model.arch:
        return None
    folder = cached_checkpoint(**checkpoint_args(spec))
    return str(folder) if folder else None


class NotTheCpuFallback(logging.Filter):
    """DeepSpeed's warning that it found no GPU: a plan runs on any machine, and needs none."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Setting accelerator to CPU" not in record.getMessage()


def main(argv: Optional[Sequence[str]] = None) -> int:
    from dsexp.analysis.sections.plan_table import render_markdown, render_terminal
    from dsexp.core.compat import quiet_optional_imports

    logging.getLogger("DeepSpeed").addFilter(NotTheCpuFallback())
    quiet_optional_imports()

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        planned = space(args.overrides, args.multirun)
    except PlanError as e:
        print(f"dsexp.plan: bad config: {e}", file=sys.stderr)
        return 2
    entries = [plan_one(p, args.replay, args.trace_in_stack) for p in planned]
    print(render_terminal(entries))
    if args.json:
        args.json.write_text(
            json.dumps({"metadata": metadata(args.replay), "configurations": entries}, indent=1) + "\n"
        )
    if args.markdown:
        args.markdown.write_text(render_markdown(entries) + "\n")
    missing = [e for e in entries if e["status"] == "not_predicted"]
    for e in missing:
        print(f"dsexp.plan: not predicted: {e['configuration']} (tp={e['tp']}): {e['reason']}", file=sys.stderr)
    return 1 if missing else 0


SCHEMA_VERSION = 2  # docs/plan-json.md


def metadata(replay: bool) -> Dict[str, Any]:
    """What a program reading the plan's JSON needs beside the figures (docs/plan-json.md)."""
    from dsexp import __version__
    from dsexp.core.compat import installed

    return {
        "dsexp_version": __version__,
        "schema_version": SCHEMA_VERSION,
        "replayed": replay,
        "software": {p: installed(p) for p in ("torch", "transformers", "deepspeed")},
        "units": {"*_bytes": "bytes", "*_seconds": "seconds", "largest_batch": "sequences per generate call"},
    }
