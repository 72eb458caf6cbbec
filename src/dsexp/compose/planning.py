"""`python -m dsexp.plan [-m] <overrides> [--json FILE] [--markdown FILE]`: every configuration the same overrides
would run, predicted from the config alone, without launching anything or reading a weight.

The config is composed by Hydra as `python -m dsexp` composes it (experiment presets, config groups, `-m` sweeps and
lists); each configuration is checked for sense (dsexp.compose.validate.validate_plan: not against this machine) and
predicted by dsexp.predict.job, the function the budget search and the report call. A configuration the model has
no rule for is listed with its reason; bad input is refused before anything is predicted, exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
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
        "--replay",
        action="store_true",
        help="with a GPU size: also replay each point's generate calls through the caching allocator "
        "(fragmentation; tp=1, or AutoTP without kernel injection; at 20B shapes a few generates traced on the meta "
        "device, seconds each, shared by the configurations of one rank model)",
    )
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for python -m dsexp")
    return p.parse_args(list(argv))


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
    return [Planned([o for o in c if o.split("=", 1)[0].lstrip("+~") in swept], checked(c)) for c in combos]


def plan_one(p: Planned, replay: bool = False) -> Dict[str, Any]:
    """One configuration's entry: its prediction (dsexp.predict.job.plan_entry), or why it has none."""
    from dsexp.compose.budget.model import predict_spec, script_config
    from dsexp.engines.placement import RULES
    from dsexp.predict import job as model

    config = script_config(p.spec)
    label = " ".join(p.overrides) or "(as composed)"
    head = {"configuration": label, "overrides": p.overrides, "model": p.spec.model.name, "tp": p.spec.tp}
    gib = p.spec.budget.gpu_gib
    t0 = time.perf_counter()
    try:
        pred = predict_spec(p.spec, model_dir=cached_folder(p.spec))
        if pred.error:
            return {**head, "status": "not_predicted", "reason": pred.error}
        gpu = int(gib * GIB) if gib else None
        entry = model.plan_entry(pred, config, RULES, model.workloads_of(config), gpu, replay)
    except Exception as e:  # a configuration the model has no rule for: said, the others still predicted
        return {**head, "status": "not_predicted", "reason": f"{type(e).__name__}: {e}"}
    return {**head, "status": "predicted", "seconds": round(time.perf_counter() - t0, 3), **entry}


def cached_folder(spec: JobConfig) -> Optional[str]:
    """The preset's checkpoint where dsexp already wrote it here (its files' sizes, never their data, size the host's
    loading cost); None: sized as the writer would pack it."""
    from dsexp.job.run import checkpoint_args
    from dsexp.models.writer import cached_checkpoint

    if spec.model.path or not spec.model.arch:
        return None
    folder = cached_checkpoint(**checkpoint_args(spec))
    return str(folder) if folder else None


def main(argv: Optional[Sequence[str]] = None) -> int:
    from dsexp.analysis.sections.plan_table import render_markdown, render_terminal

    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        planned = space(args.overrides, args.multirun)
    except PlanError as e:
        print(f"dsexp.plan: bad config: {e}", file=sys.stderr)
        return 2
    entries = [plan_one(p, args.replay) for p in planned]
    print(render_terminal(entries))
    if args.json:
        args.json.write_text(json.dumps({"configurations": entries}, indent=1) + "\n")
    if args.markdown:
        args.markdown.write_text(render_markdown(entries) + "\n")
    return 0
