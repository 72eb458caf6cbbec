"""Submitit launchers that size every job from its own config (`hydra/launcher=dsexp_slurm|dsexp_local`).

hydra-submitit-launcher resolves `hydra.launcher` once, from the sweep's primary config, and submits
one job array with those resources, so `gpus_per_node: ${tp}` would give a tp=8 job the GPUs of the
default tp. These launchers resolve `hydra.launcher` for each job (as the job itself will see it) and
submit one array per distinct request; jobs keep their sweep numbers. Each job then runs in submitit
exactly as the plugin runs it (its `__call__`): the same dsexp job code as with the basic launcher.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any, Dict, List, Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from omegaconf import DictConfig, OmegaConf

from dsexp.core.schema import per_node

# `${dsexp.per_node:${tp},${launcher.nodes}}`: GPUs each node of a job needs (the presets use it).
OmegaConf.register_new_resolver("dsexp.per_node", per_node, replace=True)

log = logging.getLogger(__name__)
_INIT_KEYS = ("submitit_folder", "max_num_timeout")


def launcher_params(cfg: DictConfig) -> Dict[str, Any]:
    """A job's resolved `hydra.launcher`, as the plugin passes it to submitit."""
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_", None)
    return params


class PerJobResources:
    """Mixin for the plugin's launchers: per-job `hydra.launcher`, one submitit array per resource request."""

    def job_params(self, overrides: Sequence[str]) -> Dict[str, Any]:
        return launcher_params(self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides)))

    def executor(self, params: Dict[str, Any]):
        """The submitit executor for these parameters, set up the way the plugin sets up its own."""
        import submitit

        init = {"folder": params["submitit_folder"]}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{k if k in shared else f"{self._EXECUTOR}_{k}": v for k, v in params.items() if k not in _INIT_KEYS}
        )
        return executor

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        groups: Dict[str, List[int]] = {}
        params: Dict[str, Dict[str, Any]] = {}
        for i, overrides in enumerate(job_overrides):
            p = self.job_params(overrides)
            key = json.dumps(p, sort_keys=True, default=str)
            groups.setdefault(key, []).append(i)
            params[key] = p
        jobs: List[Any] = [None] * len(job_overrides)
        for key, idxs in groups.items():
            p = params[key]
            log.info(f"\tarray of {len(idxs)}: nodes={p.get('nodes')} gpus_per_node={p.get('gpus_per_node')}")
            args = []
            for i in idxs:
                idx = initial_job_idx + i
                log.info(f"\t#{idx} : {' '.join(filter_overrides(job_overrides[i]))}")
                args.append(
                    (list(job_overrides[i]), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state())
                )
            for i, job in zip(idxs, self.executor(p).map_array(self, *zip(*args))):
                jobs[i] = job
        return [job.results()[0] for job in jobs]


class DsexpSlurmLauncher(PerJobResources, plugin.SlurmLauncher):
    pass


class DsexpLocalLauncher(PerJobResources, plugin.LocalLauncher):
    pass
