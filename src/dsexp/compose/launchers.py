"""Submitit launchers that size every job from its own config (`hydra/launcher=dsexp_slurm|dsexp_local`): the
Hydra side of dsexp's cluster path (what runs the jobs and follows them on SLURM, without Hydra, is
dsexp.job.cluster).

hydra-submitit-launcher resolves `hydra.launcher` once, from the sweep's primary config, and submits
one job array with those resources, so `gpus_per_node: ${tp}` would give a tp=8 job the GPUs of the
default tp. These launchers resolve `hydra.launcher` for each job (as the job itself will see it) and
submit one array per distinct request; jobs keep their sweep numbers. Each job then runs in submitit
exactly as the plugin runs it (its `__call__`): the same dsexp job code as with the basic launcher.

On SLURM (`DsexpSlurmLauncher`) the sweep process also sizes each request against the partition (sinfo):
dsexp's defaults for `cpus_per_task` and `mem_gb` are capped at the largest node, a value the user set that no
node has is a problem said before anything is submitted; it submits with `--no-requeue`
(`hydra.launcher.requeue=false`: a requeued measurement would run twice), then hands the planned jobs to
dsexp.job.cluster.slurm_sweep.SlurmSweep (resume, wait with deadlines, record SLURM's account of each job).
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from hydra.core.config_store import ConfigStore
from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher import submitit_launcher as plugin
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf, SlurmQueueConf
from omegaconf import DictConfig, OmegaConf, open_dict

from dsexp.core.schema import per_node
from dsexp.job.cluster import slurm
from dsexp.job.cluster.slurm_sweep import SlurmSweep, SweepJob, slurm_cpus, slurm_gpus, slurm_mem_gb

log = logging.getLogger(__name__)
_INIT_KEYS = ("submitit_folder", "max_num_timeout")
# dsexp's own keys in hydra.launcher (not submitit's): how the sweep process treats the jobs
_DSEXP_KEYS = ("requeue", "pending_deadline_s", "poll_s", "settle_s")
_DEFAULT_MARK = "dsexp.slurm_"  # a value left to dsexp's sizing resolvers (capped at the node); else the user's


@dataclass
class DsexpSlurmQueueConf(SlurmQueueConf):
    """submitit_slurm's keys plus dsexp's (conf/hydra/launcher/dsexp_slurm.yaml sets them all)."""

    _target_: str = "hydra_plugins.dsexp_launcher.dsexp_launcher.DsexpSlurmLauncher"
    requeue: bool = False  # false: sbatch --no-requeue (SLURM would rerun a job whose node failed, from scratch)
    pending_deadline_s: float = 900.0  # cancel a job pending this long on DOWN/DRAINED nodes; <= 0: wait forever
    poll_s: float = 2.0  # how often the sweep process asks squeue about its jobs
    settle_s: float = 45.0  # after SLURM ends a job, wait this long for its own result.json (KillWait + margin)


ConfigStore.instance().store(
    group="hydra/launcher", name="dsexp_slurm_schema", node=DsexpSlurmQueueConf, provider="dsexp"
)


# --- sizing resolvers (conf/hydra/launcher/dsexp_slurm.yaml; the sizing itself: dsexp.job.cluster.slurm_sweep) ---


def slurm_mem_gb_of_node(tp: Any, nodes: Any, model: Any) -> int:
    """slurm_mem_gb for `${model}`, which the resolver receives as an OmegaConf node."""
    plain = OmegaConf.to_container(model, resolve=True) if OmegaConf.is_config(model) else model
    return slurm_mem_gb(tp, nodes, plain)


OmegaConf.register_new_resolver("dsexp.per_node", per_node, replace=True)  # GPUs each node of a job needs
OmegaConf.register_new_resolver("dsexp.slurm_gpus", slurm_gpus, replace=True)
OmegaConf.register_new_resolver("dsexp.slurm_cpus", slurm_cpus, replace=True)
OmegaConf.register_new_resolver("dsexp.slurm_mem_gb", slurm_mem_gb_of_node, replace=True)


def launcher_params(cfg: DictConfig) -> Dict[str, Any]:
    """A job's resolved `hydra.launcher`, as the plugin passes it to submitit."""
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_", None)
    return params


def slurm_request(cfg: DictConfig) -> Tuple[Dict[str, Any], List[str]]:
    """A SLURM job's launcher parameters sized against its partition, and what no node of it can satisfy.

    dsexp's defaults (cpus_per_task, mem_gb from the resolvers) are capped at the largest node; a value the
    user set that no node has is a problem (said before anything is submitted), as is a GPU request on a
    partition without GPUs. Without sinfo (or a controller) the parameters are returned as configured."""
    params = launcher_params(cfg)
    raw = OmegaConf.to_container(cfg.hydra.launcher, resolve=False)
    problems: List[str] = []
    params["setup"] = [slurm.STARTED_SETUP, *(params.get("setup") or [])]
    if not params.get("requeue", False):
        extra = dict(params.get("additional_parameters") or {})
        if "requeue" not in extra:
            extra.setdefault("no-requeue", True)
        params["additional_parameters"] = extra
    nodes_info = slurm.partition_nodes(params.get("partition"))
    if nodes_info == []:
        known = slurm.partitions()
        problems.append(
            f"hydra.launcher.partition={params.get('partition')}: SLURM has no such partition (or it has no nodes)"
            + (f"; sinfo lists: {', '.join(known)}" if known else "")
        )
    if not nodes_info:
        return params, problems
    where = f"partition {params.get('partition') or nodes_info[0]['partition'] + ' (the default)'}"
    cpus = max((n["cpus"] or 0) for n in nodes_info)
    mem_mb = max((n["mem_mb"] or 0) for n in nodes_info)
    gpus = max(n["gpus"] for n in nodes_info)
    if cpus and params.get("cpus_per_task") and params["cpus_per_task"] > cpus:
        if _DEFAULT_MARK in str(raw.get("cpus_per_task")):
            params["cpus_per_task"] = cpus
        else:
            problems.append(
                f"hydra.launcher.cpus_per_task={params['cpus_per_task']}: the largest node of {where} has {cpus} CPUs"
            )
    if mem_mb and params.get("mem_gb") and params["mem_gb"] * 1024 > mem_mb:
        if _DEFAULT_MARK in str(raw.get("mem_gb")):
            params["mem_gb"] = mem_mb // 1024
        else:
            problems.append(
                f"hydra.launcher.mem_gb={params['mem_gb']}: the largest node of {where} has {mem_mb} MiB "
                f"(at most mem_gb={mem_mb // 1024})"
            )
    want = params.get("gpus_per_node") or 0
    if want and gpus < want:
        have = "no GPUs (sinfo: no gpu GRES)" if not gpus else f"at most {gpus} GPUs a node"
        problems.append(
            f"hydra.launcher.gpus_per_node={want}: the nodes of {where} have {have}; "
            "to run on their CPUs set device=cpu (or device=auto)"
        )
    nodes = int(params.get("nodes") or 1)
    if nodes > len(nodes_info):
        problems.append(f"hydra.launcher.nodes={nodes} (launcher.nodes): {where} has {len(nodes_info)} node(s)")
    return params, problems


class PerJobResources:
    """Mixin for the plugin's launchers: per-job `hydra.launcher`, one submitit array per resource request."""

    def job_config(self, overrides: Sequence[str]) -> DictConfig:
        return self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))

    def job_params(self, overrides: Sequence[str]) -> Dict[str, Any]:
        return launcher_params(self.job_config(overrides))

    def executor(self, params: Dict[str, Any]):
        """The submitit executor for these parameters, set up the way the plugin sets up its own."""
        import submitit

        init = {"folder": params["submitit_folder"]}
        if "max_num_timeout" in params:
            init[f"{self._EXECUTOR}_max_num_timeout"] = params["max_num_timeout"]
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, **init)
        shared = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(
            **{
                k if k in shared else f"{self._EXECUTOR}_{k}": v
                for k, v in params.items()
                if k not in _INIT_KEYS and k not in _DSEXP_KEYS
            }
        )
        return executor

    def prepare_sweep_dir(self) -> Path:
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if "mode" in self.config.hydra.sweep:
            os.chmod(sweep_dir, mode=int(str(self.config.hydra.sweep.mode), 8))
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        return sweep_dir

    def submit_groups(self, items: List[Tuple[int, Sequence[str], Dict[str, Any]]]):
        """Submit (job number, overrides, params) items, one array per distinct params; yields
        (the items of one array, its jobs or the exception sbatch raised, the time of the sbatch call)."""
        groups: Dict[str, List[Tuple[int, Sequence[str], Dict[str, Any]]]] = {}
        for item in items:
            groups.setdefault(json.dumps(item[2], sort_keys=True, default=str), []).append(item)
        for group in groups.values():
            p = group[0][2]
            log.info(
                f"\tarray of {len(group)}: nodes={p.get('nodes')} gpus_per_node={p.get('gpus_per_node')}"
                + (
                    f" cpus_per_task={p.get('cpus_per_task')} mem_gb={p.get('mem_gb')}"
                    if self._EXECUTOR == "slurm"
                    else ""
                )
            )
            args = []
            for idx, overrides, _ in group:
                log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
                args.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}", Singleton.get_state()))
            sbatch_at = time.time()
            try:
                yield group, self.executor(p).map_array(self, *zip(*args)), sbatch_at
            except Exception as e:  # sbatch refused (the local executor never does)
                if self._EXECUTOR != "slurm":
                    raise
                yield group, e, sbatch_at

    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        self.prepare_sweep_dir()
        items = [(initial_job_idx + i, ov, self.job_params(ov)) for i, ov in enumerate(job_overrides)]
        jobs: Dict[int, Any] = {}
        for group, submitted, _ in self.submit_groups(items):
            for (idx, _, _), job in zip(group, submitted):
                jobs[idx] = job
        return [jobs[initial_job_idx + i].results()[0] for i in range(len(job_overrides))]


def plan_job(launcher: "PerJobResources", num: int, overrides: List[str]) -> SweepJob:
    """One job of a SLURM sweep from its own config: its launcher parameters sized against the partition, its job
    folder and key (for resume), its validated config (as the sweep's start validated it)."""
    from dsexp.compose.config import plain, to_schema
    from dsexp.compose.validate import validate
    from dsexp.job.run import job_key

    cfg = launcher.job_config(overrides)
    params, problems = slurm_request(cfg)
    with open_dict(cfg.hydra.job):
        cfg.hydra.job.num = num
    try:
        job_dir: Optional[Path] = Path(str(cfg.hydra.sweep.dir)) / str(cfg.hydra.sweep.subdir)
    except Exception:  # a subdir naming something only the job knows (hydra.job.id): no resume for it
        job_dir = None
    try:
        spec = validate(to_schema(cfg), int(params.get("gpus_per_node") or 0))  # as the sweep's start did
        key, config, tp, rerun = job_key(spec), asdict(spec), spec.tp, spec.rerun
    except Exception:  # the sweep's start validated every job; this one changed since (recorded when it runs)
        key, config, tp, rerun = None, plain(cfg), int(cfg.get("tp") or 1), bool(cfg.get("rerun"))
    return SweepJob(num, overrides, params, job_dir, key, tp, config, rerun, problems)


def job_return(j: SweepJob) -> JobReturn:
    """What Hydra gets for a job the sweep process followed: completed, with the job's headline as its value (a
    failed job's cause is in its result.json; Hydra's multirun would stop at a failed JobReturn)."""
    ret = JobReturn(overrides=list(j.overrides), working_dir=str(j.job_dir) if j.job_dir else None)
    ret.status, ret.return_value, ret.task_name = JobStatus.COMPLETED, j.value, "dsexp"
    return ret


class DsexpSlurmLauncher(PerJobResources, plugin.SlurmLauncher):
    def launch(self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int) -> Sequence[JobReturn]:
        sweep_dir = self.prepare_sweep_dir()
        jobs = [plan_job(self, initial_job_idx + i, list(ov)) for i, ov in enumerate(job_overrides)]
        tracking = self.config.tracking
        SlurmSweep(jobs, sweep_dir, self.submit_groups, tracking.uri, tracking.experiment).run()
        return [job_return(j) for j in jobs]


class DsexpLocalLauncher(PerJobResources, plugin.LocalLauncher):
    pass
