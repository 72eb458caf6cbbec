"""From Hydra's composed DictConfig to the schema's JobConfig, and back to plain data."""

from __future__ import annotations

from typing import Any, Dict

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from dsexp.core.schema import ConfigError, JobConfig


def without_hydra(cfg: DictConfig) -> DictConfig:
    return OmegaConf.masked_copy(cfg, [k for k in cfg.keys() if k != "hydra"]) if "hydra" in cfg else cfg


def to_schema(cfg: DictConfig) -> JobConfig:
    """Merge a composed config onto the schema; type errors and unknown keys name the key."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(JobConfig), without_hydra(cfg))
        OmegaConf.resolve(merged)
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except OmegaConfBaseException as e:
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"config key '{key}': {getattr(e, 'msg', e)}") from None


def plain(cfg: DictConfig) -> Dict[str, Any]:
    """The job's settings as plain, resolved data (for a result that has no valid schema)."""
    return OmegaConf.to_container(without_hydra(cfg), resolve=True)  # type: ignore[return-value]
