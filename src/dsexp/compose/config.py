"""From Hydra's composed DictConfig to the schema's JobConfig, and back to plain data."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Dict, Sequence

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dsexp.core.schema import ConfigError, JobConfig


def conf_dir() -> str:
    """conf/ of the source tree (editable install), or the copy packed into the wheel."""
    here = Path(__file__).resolve().parents[1]
    for cand in (here.parent.parent / "conf", here / "conf"):
        if (cand / "config.yaml").is_file():
            return str(cand)
    raise FileNotFoundError("dsexp: cannot find conf/config.yaml")


SCHEMA = "dsexp_schema"  # the first entry of conf/config.yaml's defaults list


def register_schema() -> None:
    """Give Hydra the schema (JobConfig) as `dsexp_schema`: every key's default is written there alone; conf/ sets
    only what differs, an override of any key composes whether or not a YAML file names it, and a value of the
    wrong type is refused as the config is composed."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA, node=JobConfig)


register_schema()  # on import, as Hydra apps register their structured configs: any composition here finds it


def config_error(e: BaseException) -> str:
    """One line naming the key and what is wrong with it, from OmegaConf's error or Hydra's (whose own message is
    "Error merging override tp=two", the key's error as its cause)."""
    cause = e if isinstance(e, OmegaConfBaseException) else e.__cause__
    if isinstance(cause, OmegaConfBaseException):
        key = getattr(cause, "full_key", None) or "?"
        return f"config key '{key}': {str(getattr(cause, 'msg', cause)).splitlines()[0]}" + add_it(e)
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def add_it(e: BaseException) -> str:
    """Hydra adds a key the composed config does not have only with a leading `+` (a model preset without dims:
    `'+model.dims={...}'`): where its message says so, that line."""
    hint = next((line for line in str(e).splitlines() if "To append to your config use +" in line), None)
    if hint is None:
        return ""
    given = hint.split(" use ", 1)[1].split("=", 1)[0]
    return f"; {given[1:]} is not in the composed config: add it with a leading +, as '{given}=...'"


def compose_app(overrides: Sequence[str] = (), hydra: bool = False) -> DictConfig:
    """The config `python -m dsexp <overrides>` would run, composed without running anything (hydra: with Hydra's own
    node, where its sweeper's params are)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=conf_dir(), version_base="1.3"):
        return compose("config", overrides=list(overrides), return_hydra_config=hydra)


def without_hydra(cfg: DictConfig) -> DictConfig:
    return OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg


def to_schema(cfg: DictConfig) -> JobConfig:
    """Merge a composed config onto the schema; type errors and unknown keys name the key."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), without_hydra(cfg))
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        raise ConfigError(config_error(e)) from None


def plain(cfg: DictConfig) -> Dict[str, Any]:
    """The job's settings as plain, resolved data (for a result that has no valid schema)."""
    return OmegaConf.to_container(without_hydra(cfg), resolve=True)  # type: ignore[return-value]
