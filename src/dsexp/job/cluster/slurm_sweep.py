"""The sweep process's side of a SLURM sweep (`hydra/launcher=dsexp_slurm`), without Hydra: what each job asks
SLURM for, and following the submitted jobs to their end. The launcher (dsexp.compose.launchers) plans each job
from its own config, submits it through submitit and hands the outcomes back to Hydra.

- sizing (the `dsexp.slurm_*` resolvers of conf/hydra/launcher/dsexp_slurm.yaml): no GPUs on nodes without GPU
  GRES when `device` is cpu or auto; `cpus_per_task` and `mem_gb` from the job;
- on a resumed sweep (same command, same `hydra.sweep.dir`) only what is unfinished is submitted: jobs with an ok
  result are skipped, jobs still queued or running from the earlier sweep process (found through submitit's
  `<sweep>/.submitit/*/*_submitted.pkl` and squeue) are waited for, not submitted again;
- the sweep process waits for every job itself, polling squeue (submitit's own wait has no deadline and notices a
  job SLURM killed only 30-40 s late): a job pending on DOWN/DRAINED nodes for `pending_deadline_s` is cancelled;
- when a job has ended, SLURM's final state is merged into its result.json (dsexp.job.cluster.slurm.merge_outcome)
  and MLflow: a job SLURM cancelled, lost with its node or stopped at its time limit is a failed result with its
  cause, and the sweep goes on (Hydra's multirun would stop at the first job that raises).

submitit is imported where it is used: the job's own process (and a GPU image without submitit) never needs it.
"""

from __future__ import annotations

import glob
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Tuple

from dsexp.core.schema import per_node
from dsexp.job.cluster import slurm

log = logging.getLogger(__name__)
_GIB = 2**30


# --- sizing (the resolvers of conf/hydra/launcher/dsexp_slurm.yaml) ---


def slurm_gpus(device: Any, tp: Any, nodes: Any, partition: Any = None) -> Optional[int]:
    """GPUs per node for a job: none for device=cpu, and none for device=auto where the partition's nodes have
    no GPU (sinfo's GRES), so a GPU-less cluster is not asked for GPUs it would refuse at submit."""
    if str(device) == "cpu":
        return None
    if str(device) == "auto":
        nodes_info = slurm.partition_nodes(str(partition) if partition else None)
        if nodes_info is not None and not any(n["gpus"] for n in nodes_info):
            return None
    return per_node(int(tp), int(nodes))


def slurm_cpus(tp: Any, nodes: Any) -> int:
    """One CPU per rank on the node, plus one for the job process (the launcher caps it at the largest node)."""
    return per_node(int(tp), int(nodes)) + 1


def slurm_mem_gb(tp: Any, nodes: Any, model: Any) -> int:
    """Host memory per node (GiB): 3 for the job process and the tp=1 reference, the checkpoint once (its page
    cache is charged to the job), and per rank 1 plus a private copy of the weights (an eager load that
    converts dtypes makes one). An upper bound for the largest case; capped at the largest node."""
    weights = checkpoint_gib(model)
    return math.ceil(3 + weights + per_node(int(tp), int(nodes)) * (1 + weights))


def checkpoint_gib(model: Any) -> float:
    """The model's weights (GiB): the files of model.path, else counted from the preset's dims (`model`: the
    config's model group, a mapping)."""
    m = dict(model or {})
    if m.get("path"):
        folder = Path(str(m["path"])).expanduser()
        files = [p for ext in ("*.safetensors", "*.bin", "*.pt") for p in folder.glob(ext)] if folder.is_dir() else []
        return sum(p.stat().st_size for p in files) / _GIB
    d = m.get("dims") or {}
    try:
        h, inter, layers = int(d["hidden_size"]), int(d["intermediate_size"]), int(d["num_hidden_layers"])
        heads, vocab = int(d["num_attention_heads"]), int(d["vocab_size"])
        kv = int(d.get("num_key_value_heads") or heads)
    except (KeyError, TypeError, ValueError):
        return 0.0
    per_layer = h * h + 2 * h * (h // heads) * kv + h * h + 3 * h * inter + 2 * h
    params = layers * per_layer + 2 * vocab * h + h
    return params * {"fp32": 4}.get(str(m.get("dtype")), 2) / _GIB


@dataclass
class SweepJob:
    """One job of a SLURM sweep, as the sweep process follows it (planned from its config by the launcher)."""

    num: int
    overrides: List[str]
    params: Dict[str, Any]
    job_dir: Optional[Path]
    key: Optional[str]
    tp: int
    config: Dict[str, Any]
    rerun: bool = False
    problems: List[str] = field(default_factory=list)
    job: Any = None  # submitit's SlurmJob
    slurm_id: Optional[str] = None
    sbatch_at: Optional[float] = None
    reattached: bool = False
    pending_since: Optional[float] = None
    deadline: Optional[str] = None
    ended_at: Optional[float] = None
    final: Optional[Dict[str, str]] = None  # SLURM's record once the job has ended ({}: SLURM forgot it)
    settle_until: float = 0.0
    seen: str = ""
    done: bool = False  # ended (or skipped): `value` is what Hydra gets as the job's return value
    value: Any = None


class SlurmSweep:
    """A SLURM sweep once planned: resume, submit, wait (with deadlines), record what SLURM says. Each job ends
    `done`, with its value for Hydra (dsexp.compose.launchers.DsexpSlurmLauncher makes it a JobReturn)."""

    def __init__(
        self,
        jobs: List[SweepJob],
        sweep_dir: Path,
        submit: Callable[[List[Tuple[int, Sequence[str], Dict[str, Any]]]], Iterator[Tuple[list, Any, float]]],
        tracking_uri: Optional[str],
        experiment: str,
    ):
        """`submit` is the launcher's: it submits (job number, overrides, params) items, one array per distinct
        params, and yields (the items of one array, its submitit jobs or the exception sbatch raised, the time of
        the sbatch call). `tracking_uri` and `experiment` are the sweep's `tracking.*`."""
        self.jobs, self.sweep_dir, self.submit = jobs, sweep_dir, submit
        self.tracking_uri, self.experiment = tracking_uri, experiment
        cpu_only = [j.num for j in self.jobs if j.config.get("device") == "cpu" and not j.params.get("gpus_per_node")]
        if cpu_only:
            log.info(f"\tjobs {cpu_only} run on CPU and ask SLURM for no GPU (device=cpu, or no GPU in the partition)")

    # --- the sweep ---

    def run(self) -> List[SweepJob]:
        earlier = earlier_submissions(self.jobs[0].params["submitit_folder"]) if self.jobs else {}
        todo = []
        for j in self.jobs:
            if self.resume(j, earlier.get(j.num, [])):
                continue
            if j.problems:  # cannot run on this cluster (checked at the sweep's start too)
                self.finish(j, error_text="; ".join(j.problems), cause_note="slurm_rejected")
                continue
            todo.append(j)
        by_num = {j.num: j for j in todo}
        for group, submitted, sbatch_at in self.submit([(j.num, j.overrides, j.params) for j in todo]):
            if isinstance(submitted, Exception):
                for idx, _, _ in group:
                    self.finish(
                        by_num[idx], error_text=f"sbatch refused the job: {submitted}", cause_note="slurm_rejected"
                    )
                continue
            for (idx, _, _), job in zip(group, submitted):
                j = by_num[idx]
                j.job, j.slurm_id, j.sbatch_at = job, job.job_id, sbatch_at
                log.info(f"\t#{idx} : SLURM job {j.slurm_id}")
        try:
            self.wait()
        except KeyboardInterrupt:
            left = [j.slurm_id for j in self.jobs if not j.done and j.slurm_id]
            log.warning(
                f"\tstopped waiting; SLURM jobs {left} go on: the same command (same hydra.sweep.dir) waits for them "
                "again and submits only what is unfinished, or scancel them"
            )
            raise
        return self.jobs

    def resume(self, j: SweepJob, earlier: List[Tuple[str, float]]) -> bool:
        """A job an earlier sweep process already submitted: wait for it if SLURM still has it queued or running,
        record its end if that sweep process died before it could; skip a job whose result is ok. True if
        nothing is to be submitted."""
        from dsexp.core.fs import read_json
        from dsexp.job.run import find_ok_result

        if earlier:
            jid, at = earlier[-1]
            if slurm.active([jid]):
                j.job, j.slurm_id, j.sbatch_at, j.reattached = self.slurm_job(jid, j), jid, at, True
                log.info(
                    f"\t#{j.num} : SLURM job {jid} of an earlier sweep process is still queued or running: waiting"
                )
                return True
            res = read_json(j.job_dir / "result.json") if j.job_dir else None
            mine = res is None or (res.get("slurm") or {}).get("job_id") == jid
            if mine and not (res or {}).get("slurm", {}).get("state"):  # ended after that process died
                j.slurm_id, j.sbatch_at, j.reattached = jid, at, True
                j.job = self.slurm_job(jid, j)
                self.finish(j, error_text=self.outcome_error(j))
                j.job, j.done, j.value = None, False, None
        if j.key and not j.rerun:
            prior = find_ok_result(self.sweep_dir, j.key)
            if prior is not None:
                log.info(f"\t#{j.num} : already ok in {prior.get('job_dir')}: not submitted")
                j.done, j.value = True, prior.get("headline")
                return True
        return False

    def slurm_job(self, jid: str, j: SweepJob):
        from submitit.slurm.slurm import SlurmJob

        tasks = list(range(int(j.params.get("nodes") or 1) * int(j.params.get("tasks_per_node") or 1)))
        return SlurmJob(folder=j.params["submitit_folder"], job_id=jid, tasks=tasks)

    def wait(self) -> None:
        """Until every submitted job has ended: poll squeue; a job gone from it has ended (scontrol/sacct give its
        final state); a job pending on DOWN/DRAINED nodes past pending_deadline_s is cancelled. Once SLURM says a
        job ended, its own process may still be finishing (SLURM sends SIGTERM, and SIGKILL KillWait later; a
        NODE_FAIL is declared at once): its record waits up to settle_s for the job's own result.json."""
        waiting = [j for j in self.jobs if j.job is not None and not j.done]
        poll = min([float(j.params.get("poll_s") or 2.0) for j in waiting] or [2.0])
        while waiting:
            now = time.monotonic()
            queued = slurm.active(j.slurm_id for j in waiting if j.final is None)
            for j in waiting:
                if j.final is None:
                    self.follow(j, queued.get(j.slurm_id), now)
                if j.final is not None and self.settled(j, now):
                    self.finish(j, error_text=self.outcome_error(j), record=j.final or None)
            waiting = [j for j in waiting if not j.done]
            if waiting:
                time.sleep(poll)

    def follow(self, j: SweepJob, st: Optional[Dict[str, str]], now: float) -> None:
        """One poll of a job still in SLURM's hands: note its state, apply the pending deadline, see it end."""
        if st is None:  # not in squeue's answer: ended, or squeue failed (ask scontrol/sacct)
            rec = slurm.record(j.slurm_id)
            state = (rec or {}).get("JobState")
            if state in slurm.TERMINAL:
                allocated = slurm.node_list(rec.get("NodeList")) is not None
                settle = 15.0 if state == "COMPLETED" else float(j.params.get("settle_s") or 0) if allocated else 0.0
                j.final, j.settle_until = rec, now + settle
                return
            if rec is None:  # SLURM knows nothing of it (anymore): give it a minute, then record that
                j.ended_at = j.ended_at or now
                if now - j.ended_at > 60:
                    j.final, j.settle_until = {}, now
                return
            st = {"state": state or "?", "reason": rec.get("Reason", ""), "nodes": rec.get("NodeList", "")}
        j.ended_at = None
        if st["state"] != j.seen:
            j.seen = st["state"]
            reason = st["reason"] if st["reason"] not in ("", "None") else ""
            log.info(f"\t#{j.num} : SLURM job {j.slurm_id} {st['state']} {reason}".rstrip())
        self.check_deadline(j, st, now)

    def settled(self, j: SweepJob, now: float) -> bool:
        """Whether the ended job's own process is done writing: its result pickles (all tasks) are there, or it
        has written its result.json (a job stopped by SLURM writes no pickle), or settle_s has passed."""
        if now >= j.settle_until or self.pickles_ready(j):
            return True
        return (
            (j.final or {}).get("JobState") != "COMPLETED"
            and j.job_dir is not None
            and (slurm.own_result(j.job_dir, j.slurm_id) is not None)
        )

    def check_deadline(self, j: SweepJob, st: Dict[str, str], now: float) -> None:
        deadline = float(j.params.get("pending_deadline_s") or 0)
        if st["state"] != "PENDING" or deadline <= 0 or j.deadline:
            return
        if not slurm.stuck_on_down_nodes(st["reason"], j.params.get("partition"), int(j.params.get("nodes") or 1)):
            j.pending_since = None
            return
        j.pending_since = j.pending_since or now
        if now - j.pending_since >= deadline:
            j.deadline = (
                f"pending on DOWN/DRAINED nodes for {now - j.pending_since:.0f} s "
                f"(reason {st['reason']}; hydra.launcher.pending_deadline_s={deadline:g}): cancelled by dsexp"
            )
            log.warning(f"\t#{j.num} : SLURM job {j.slurm_id} {j.deadline}")
            slurm.cancel(j.slurm_id)

    def pickles_ready(self, j: SweepJob) -> bool:
        tasks = [j.job.task(i) for i in range(j.job.num_tasks)] if j.job is not None else []
        return bool(tasks) and all(t.paths.result_pickle.exists() for t in tasks)

    def outcome_error(self, j: SweepJob) -> str:
        """What submitit's result pickle says went wrong ('' for a success or no pickle)."""
        if not self.pickles_ready(j):
            return ""
        try:
            ret = j.job.results()[0]
        except Exception as e:  # FailedJobError: the job raised (e.g. submitit's time-limit handler)
            return str(e)[-4000:]
        if getattr(getattr(ret, "status", None), "name", None) == "FAILED":  # Hydra's JobReturn, JobStatus.FAILED
            return f"{type(ret._return_value).__name__}: {ret._return_value}"[-4000:]
        return ""

    # --- recording ---

    def finish(
        self,
        j: SweepJob,
        error_text: str = "",
        record: Optional[Dict[str, str]] = None,
        cause_note: Optional[str] = None,
    ) -> None:
        """The job has ended (or could not be submitted): complete its result.json with SLURM's account, bring
        MLflow up to date, and mark it done (Hydra gets a completed JobReturn) so the sweep goes on."""
        result = self.record(j, error_text, record, cause_note)
        if j.slurm_id:
            state = (result.get("slurm") or {}).get("state")
            how = result.get("status") + (f" ({result['failure']['cause']})" if result.get("failure") else "")
            log.info(f"\t#{j.num} : SLURM job {j.slurm_id} ended {state}: {how}")
        j.done, j.value = True, result.get("headline")

    def record(self, j: SweepJob, error_text: str, rec: Optional[Dict[str, str]], cause_note: Optional[str]) -> Dict:
        from dsexp.core.fs import read_json, write_json_atomic
        from dsexp.core.records import SCHEMA_VERSION
        from dsexp.job import failures
        from dsexp.job.run import archive_attempt, attempt_summary, provenance
        from dsexp.tracking.runs import record_cluster_outcome, resolve_uri

        if j.job_dir is None:
            return {}
        j.job_dir.mkdir(parents=True, exist_ok=True)
        path = j.job_dir / "result.json"
        res = read_json(path)
        mine = res if j.slurm_id and slurm.written_by(res, j.slurm_id) else None
        if mine is None:  # the job wrote nothing (killed before it could, or never started): a result from SLURM
            if res is not None:  # an earlier attempt's: keep it, as a retried job does
                earlier, reached = archive_attempt(j.job_dir), {}
            else:
                earlier, reached = attempt_summary(j.job_dir), failures.reached(j.job_dir, j.tp)
            base = {
                "schema": SCHEMA_VERSION,
                "key": j.key,
                "job_dir": str(j.job_dir),
                "config": j.config,
                "status": "failed",
                "attempt": len(earlier) + 1,
                "attempt_id": uuid.uuid4().hex,
                "earlier_attempts": earlier,
                **provenance(),  # the sweep's process carries the campaign's settings too
            }
        else:
            # an ok result stays as the job wrote it (slurm.merge_outcome): no need to read the ranks' files
            base, reached = mine, ({} if mine.get("status") == "ok" else failures.reached(j.job_dir, j.tp))
        if cause_note == "slurm_rejected":  # never reached SLURM's queue
            result = {
                **base,
                "failure": {
                    "cause": "slurm_rejected",
                    "rank": None,
                    "phase": None,
                    "type": "sbatch",
                    "message": error_text[:2000],
                },
            }
        else:
            rec = rec if rec is not None else (slurm.record(j.slurm_id) if j.slurm_id else None)
            own = (mine or {}).get("slurm") or {"job_id": j.slurm_id}
            facts = slurm.facts(rec, j.sbatch_at, own, ((mine or {}).get("clock") or {}).get("task"))
            result = slurm.merge_outcome(base, facts, reached, error_text, j.deadline)
            result["slurm"]["resumed"] = j.reattached or None
        result.setdefault("clock", {})["recorded_by_sweep"] = time.time()
        write_json_atomic(path, result)
        uri = resolve_uri(self.tracking_uri, Path(os.getcwd()))
        record_cluster_outcome(result, j.job_dir, self.sweep_dir, uri, self.experiment)
        return result


def earlier_submissions(submitit_folder: str) -> Dict[int, List[Tuple[str, float]]]:
    """{job number: [(SLURM job id, time of its sbatch call), ...] oldest first} for every job submitit submitted
    into this folder pattern (`<sweep>/.submitit/%j`): each `<id>_submitted.pkl` holds the job's arguments, the
    third being Hydra's job number. The sbatch call's time is that of the submission file submitit writes just
    before calling sbatch."""
    from submitit.core.utils import DelayedSubmission

    out: Dict[int, List[Tuple[str, float]]] = {}
    pattern = str(submitit_folder)
    for pkl in glob.glob(os.path.join(glob.escape(pattern).replace("%j", "*"), "*_submitted.pkl")):
        jid = Path(pkl).name[: -len("_submitted.pkl")]
        try:
            num = int(DelayedSubmission.load(pkl).args[2])
        except Exception:  # not a Hydra job, or unreadable: not ours to resume
            continue
        array = jid.split("_")[0]
        script = Path(pattern.replace("%j", array)) / f"{array}_submission.sh"
        at = (script if script.exists() else Path(pkl)).stat().st_mtime
        out.setdefault(num, []).append((jid, at))
    for subs in out.values():
        subs.sort(key=lambda s: tuple(int(x) for x in s[0].split("_") if x.isdigit()))
    return out
