"""Expand a multirun into its job configs and validate each one before any job is launched."""

from __future__ import annotations

from typing import Dict, List, Optional, Tuple

from omegaconf import DictConfig, OmegaConf

from dsexp.compose.config import config_error, to_schema
from dsexp.compose.validate import validate
from dsexp.core.schema import ConfigError, JobConfig


def sweep_combinations(config: DictConfig) -> List[List[str]]:
    """The override lists Hydra's basic sweeper will run (sweeper params from presets + command line)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = OmegaConf.select(config, "hydra.sweeper.params") or {}
    args = [f"{k}={v}" for k, v in params.items()] + list(config.hydra.overrides.task)
    parsed = OverridesParser.create().parse_overrides(args)
    return [combo for batch in BasicSweeper.split_arguments(parsed, None) for combo in batch]


def validate_sweep(config: DictConfig) -> List[Tuple[List[str], str]]:
    """[(overrides, message)] for every combination that cannot run; empty if all are fine."""
    return check_sweep(config)[0]


def check_sweep(config: DictConfig) -> Tuple[List[Tuple[List[str], str]], List[Tuple[List[str], JobConfig]]]:
    """(errors as validate_sweep gives them, [(overrides, validated spec)] of the combinations that can run)."""
    from hydra import compose
    from hydra.errors import HydraException, MissingConfigException

    errors, specs = [], []
    hydra_overrides = list(config.hydra.overrides.hydra)  # e.g. the launcher, which decides the GPUs
    for combo in sweep_combinations(config):
        try:
            job_cfg = compose(
                config_name=config.hydra.job.config_name, overrides=hydra_overrides + combo, return_hydra_config=True
            )
            gpus = requested_gpus(job_cfg)
            spec = validate(to_schema(job_cfg), gpus)
            slurm_problems = slurm_request_problems(job_cfg)
            if slurm_problems:
                raise ConfigError("; ".join(slurm_problems))
            if spec.launcher.pack and gpus is not None:
                raise ConfigError(
                    "launcher.pack=true shares out the GPUs of this machine; with a SLURM launcher "
                    "SLURM gives every job its own: set launcher.pack=false"
                )
            specs.append((combo, spec))
        except (ConfigError, HydraException) as e:
            msg = config_error(e)
            if isinstance(e, MissingConfigException) and e.options:
                msg += f"; choose one of: {', '.join(sorted(e.options))}"
            errors.append((combo, msg))
    return errors, specs


def prepare_stacks(specs: List[Tuple[List[str], JobConfig]]) -> List[Tuple[List[str], str]]:
    """Prepare every software stack the sweep uses, once each, before any job; [(overrides, message)] for the
    combinations whose stack cannot be prepared (a pin that does not exist, pins that conflict, ...)."""
    from dsexp.job.overlay import StackError, prepare_stack, stack_key

    failed: Dict[Tuple[str, str], str] = {}
    for _, spec in specs:
        where = (stack_key(spec.stack), spec.cache_dir)
        if where in failed:
            continue
        try:
            info = prepare_stack(spec.stack, spec.cache_dir)
            failed[where] = ""
            if info.get("cache_hit") is False:
                packages = " ".join(info["packages"])
                print(f"dsexp: stack {info['label']} prepared in {info['prepare_s']:.1f} s: {packages}")
        except StackError as e:
            failed[where] = str(e)
    return [
        (combo, failed[(stack_key(s.stack), s.cache_dir)])
        for combo, s in specs
        if failed[(stack_key(s.stack), s.cache_dir)]
    ]


def slurm_request_problems(job_cfg: DictConfig) -> List[str]:
    """With hydra/launcher=dsexp_slurm: what the job asks for that no node of its partition has (sinfo)."""
    launcher = OmegaConf.select(job_cfg, "hydra.launcher")
    if launcher is None or not str(launcher.get("_target_", "")).endswith("DsexpSlurmLauncher"):
        return []
    from dsexp.compose.launchers import slurm_request

    return slurm_request(job_cfg)[1]


def requested_gpus(job_cfg: DictConfig) -> Optional[int]:
    """GPUs per node a SLURM launcher asks for this job (it runs elsewhere, not on the GPUs seen here); else None."""
    launcher = OmegaConf.select(job_cfg, "hydra.launcher")
    if launcher is None or not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
        return None
    return int(launcher.get("gpus_per_node") or 0)
