"""What dsexp asks SLURM, and how a SLURM job's end becomes part of a dsexp result.

Two sides:

- the job process (on the node): `env_facts()` reads the allocation from the environment SLURM sets
  (SLURM_JOB_ID, SLURMD_NODENAME, the array ids, ...) into `result.json["slurm"]`;
- the login side (the sweep process, `dsexp.job.cluster.slurm_sweep`): asks SLURM about the jobs it submitted
  (`active`: squeue; `record`: `scontrol show job`, then `sacct` once slurmctld has forgotten the job), sizes
  requests against the partition's nodes (`partition_nodes`: sinfo), and, when a job has ended, merges SLURM's
  final state into the job's result (`merge_outcome`): a job SLURM cancelled, lost with its node or stopped at
  its time limit becomes a failed result with a cause (`slurm_cancelled`, `node_failed`, `time_limit`), keeping
  what the job itself recorded (the phase each rank reached, memory, logs).

Every call is an argument list with a timeout; a SLURM command that is missing or fails gives None/{}, never an
exception, so the caller decides (sizing falls back to the config, waiting goes on).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional

from dsexp.core.fs import read_json

# SLURM job states: a job in one of these has ended for good (with --no-requeue).
TERMINAL = frozenset(
    "BOOT_FAIL CANCELLED COMPLETED DEADLINE FAILED NODE_FAIL OUT_OF_MEMORY PREEMPTED TIMEOUT REVOKED "
    "SPECIAL_EXIT".split()
)
# SLURM's final state -> dsexp's cause, for states that mean SLURM (not the job's own code) ended the job.
STATE_CAUSES = {
    "CANCELLED": "slurm_cancelled",
    "PREEMPTED": "slurm_cancelled",
    "REVOKED": "slurm_cancelled",
    "NODE_FAIL": "node_failed",
    "BOOT_FAIL": "node_failed",
    "TIMEOUT": "time_limit",
    "DEADLINE": "time_limit",
    "OUT_OF_MEMORY": "oom_host",
}
# Pending reasons that name unusable nodes (squeue %r / scontrol Reason=).
_DOWN_REASON = re.compile(r"DOWN|DRAIN|ReqNodeNotAvail|NodeDown|PartitionDown|PartitionInactive", re.I)
_UNUSABLE_NODE = re.compile(r"^(down|drain|drng|drained|draining|fail|failing|inval|maint|future|unk|power)", re.I)
# submitit's own message when SLURM's USR2 came near the time limit (`--signal=USR2@<signal_delay_s>`)
_SUBMITIT_TIMED_OUT = re.compile(r"timed-out|Job has timed out", re.I)
_ENV = {
    "SLURM_JOB_ID": "raw_job_id",
    "SLURM_ARRAY_JOB_ID": "array_job_id",
    "SLURM_ARRAY_TASK_ID": "array_task_id",
    "SLURMD_NODENAME": "node",
    "SLURM_JOB_NODELIST": "nodelist",
    "SLURM_JOB_NUM_NODES": "num_nodes",
    "SLURM_JOB_PARTITION": "partition",
    "SLURM_CPUS_ON_NODE": "cpus_on_node",
    "SLURM_MEM_PER_NODE": "mem_per_node_mb",
    "SLURM_MEM_PER_CPU": "mem_per_cpu_mb",
    "SLURM_RESTART_COUNT": "restart_count",
    "SLURM_CLUSTER_NAME": "cluster",
}
TIMEOUT_S = 20
STARTED_ENV = "DSEXP_SLURM_STARTED"
# the first line of every dsexp batch script: when the job started on its node, to the sub-second
STARTED_SETUP = f"export {STARTED_ENV}=$(date +%s.%N)"


def available() -> bool:
    return shutil.which("squeue") is not None and shutil.which("scontrol") is not None


def _run(args: List[str], timeout: float = TIMEOUT_S) -> Optional[subprocess.CompletedProcess]:
    try:
        return subprocess.run(args, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None


# ------------------------------------------------------------------------------------------ the job side


def job_id(env: Optional[Dict[str, str]] = None) -> Optional[str]:
    """This job's id as submitit and squeue name it: `12`, or `12_3` for task 3 of array 12."""
    env = os.environ if env is None else env
    if not env.get("SLURM_JOB_ID"):
        return None
    if env.get("SLURM_ARRAY_JOB_ID") and env.get("SLURM_ARRAY_TASK_ID"):
        return f"{env['SLURM_ARRAY_JOB_ID']}_{env['SLURM_ARRAY_TASK_ID']}"
    return env["SLURM_JOB_ID"]


def env_facts(env: Optional[Dict[str, str]] = None) -> Optional[Dict[str, Any]]:
    """The allocation this process runs in, from SLURM's environment; None outside SLURM."""
    env = os.environ if env is None else env
    jid = job_id(env)
    if jid is None:
        return None
    out: Dict[str, Any] = {"job_id": jid}
    for var, key in _ENV.items():
        if env.get(var):
            out[key] = (
                int(env[var]) if env[var].isdigit() and key not in ("node", "nodelist", "partition") else env[var]
            )
    try:  # the batch script's first line on the node (dsexp_slurm adds it to `setup`): the job's start
        out["started_at"] = float(env[STARTED_ENV])
    except (KeyError, ValueError):
        pass
    return out


def written_by(res: Optional[Dict[str, Any]], jid: str) -> bool:
    """Whether this result was written by SLURM job `jid` (not by an earlier attempt)."""
    return bool(res) and (res.get("slurm") or {}).get("job_id") == jid


def own_result(job_dir: Path, jid: str) -> Optional[Dict[str, Any]]:
    """The job's result.json if SLURM job `jid` wrote it (else None: not yet, or an earlier attempt's)."""
    res = read_json(Path(job_dir) / "result.json")
    return res if written_by(res, jid) else None


def recorded_by_sweep(job_dir: Path, jid: str) -> bool:
    """Whether the sweep process has already recorded the end of SLURM job `jid` in this job's result.json."""
    res = read_json(Path(job_dir) / "result.json") or {}
    facts = res.get("slurm") or {}
    return facts.get("job_id") == jid and bool(facts.get("state"))


# ------------------------------------------------------------------------------------------ the login side


def parse_record(line: str) -> Dict[str, str]:
    """`Key=value Key2=value two ...` (scontrol -o) -> dict; a value runs to the next ` Key=`."""
    parts = re.split(r"\s+(?=[A-Za-z][A-Za-z0-9_:/]*=)", line.strip())
    return dict(p.split("=", 1) for p in parts if "=" in p)


def _key(rec: Dict[str, str]) -> str:
    a, t = rec.get("ArrayJobId"), rec.get("ArrayTaskId")
    if a and t not in (None, "", "N/A") and t.isdigit():
        return f"{a}_{t}"
    return rec.get("JobId", "")


def active(ids: Iterable[str]) -> Dict[str, Dict[str, str]]:
    """{id: {state, reason, nodes}} for the given jobs SLURM still has queued or running (squeue, one call).
    A job missing from the answer has left the queue (or squeue failed: see `record`)."""
    ids = sorted(set(ids))
    if not ids:
        return {}
    proc = _run(["squeue", "-h", "-r", "-t", "all", "-j", ",".join(ids), "-o", "%i|%T|%r|%N"])
    if proc is None or proc.returncode != 0:  # an id SLURM forgot makes squeue refuse them all: ask one by one
        if len(ids) == 1:
            return {}
        out: Dict[str, Dict[str, str]] = {}
        for i in ids:
            out.update(active([i]))
        return out
    out = {}
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) >= 4 and parts[0] in ids and parts[1] not in TERMINAL:
            out[parts[0]] = {"state": parts[1], "reason": parts[2], "nodes": parts[3]}
    return out


def record(jid: str) -> Optional[Dict[str, str]]:
    """SLURM's record of one job (`12` or `12_3`): `scontrol show job` while slurmctld keeps it (MinJobAge after
    it ends), else `sacct` (the accounting database). Keys as scontrol names them: JobState, Reason, NodeList,
    SubmitTime, StartTime, EndTime, ExitCode, ...; plus Source."""
    proc = _run(["scontrol", "show", "job", "-o", jid])
    if proc is not None and proc.returncode == 0:
        for line in proc.stdout.splitlines():
            rec = parse_record(line)
            if _key(rec) == jid or (rec.get("JobId") == jid and "_" not in jid):
                rec["JobState"] = rec.get("JobState", "").split(" ")[0]
                return {**rec, "Source": "scontrol"}
    fields = ["JobID", "State", "NodeList", "Submit", "Start", "End", "ExitCode", "Reason"]
    proc = _run(["sacct", "-n", "-P", "-X", "-j", jid, "-o", ",".join(fields)])
    if proc is not None and proc.returncode == 0:
        for line in proc.stdout.splitlines():
            vals = dict(zip(fields, line.split("|")))
            if vals.get("JobID") == jid:
                return {
                    "JobId": jid,
                    "JobState": (vals.get("State") or "").split(" ")[0],
                    "NodeList": vals.get("NodeList", ""),
                    "SubmitTime": vals.get("Submit", ""),
                    "StartTime": vals.get("Start", ""),
                    "EndTime": vals.get("End", ""),
                    "ExitCode": vals.get("ExitCode", ""),
                    "Reason": vals.get("Reason", ""),
                    "Source": "sacct",
                }
    return None


def cancel(jid: str) -> bool:
    proc = _run(["scancel", jid])
    return proc is not None and proc.returncode == 0


_NODES: Dict[Optional[str], Optional[List[Dict[str, Any]]]] = {}


def partition_nodes(partition: Optional[str] = None, fresh: bool = False) -> Optional[List[Dict[str, Any]]]:
    """The nodes of a partition (the default one for None) as sinfo reports them: name, cpus, mem_mb, gpus
    (from GRES), state; [] for a partition SLURM does not have. None where SLURM cannot be asked (no sinfo, no
    controller). Asked once per process (sizing resolves every job's config) unless `fresh` (states change)."""
    if fresh or partition not in _NODES:
        _NODES[partition] = _sinfo_nodes(partition)
    return _NODES[partition]


def _sinfo_nodes(partition: Optional[str]) -> Optional[List[Dict[str, Any]]]:
    args = ["sinfo", "-h", "-N", "-o", "%N|%P|%c|%m|%G|%T"]
    if partition:
        args += ["-p", str(partition)]
    proc = _run(args, timeout=10)
    if proc is None or proc.returncode != 0:
        return None
    nodes = []
    for line in proc.stdout.splitlines():
        parts = line.strip().split("|")
        if len(parts) < 6:
            continue
        name, part, cpus, mem, gres, state = parts[:6]
        if not partition and not part.endswith("*"):  # sinfo marks the default partition with '*'
            continue
        nodes.append(
            {
                "name": name,
                "partition": part.rstrip("*"),
                "cpus": int(cpus) if cpus.isdigit() else None,
                "mem_mb": int(re.sub(r"\D.*", "", mem) or 0) or None,
                "gpus": gres_gpus(gres),
                "state": state,
            }
        )
    return nodes


def partitions() -> List[str]:
    """The partitions SLURM has (sinfo), [] if it cannot be asked."""
    proc = _run(["sinfo", "-h", "-o", "%R"], timeout=10)
    return sorted(set(proc.stdout.split())) if proc is not None and proc.returncode == 0 else []


def gres_gpus(gres: str) -> int:
    """GPUs in a GRES string: `gpu:h100:8(S:0-1)` -> 8, `(null)` -> 0."""
    total = 0
    for item in (gres or "").split(","):
        m = re.match(r"gpu(?::[^:(]+)?:(\d+)", item.strip())
        if m:
            total += int(m.group(1))
        elif item.strip().startswith("gpu") and ":" not in item:
            total += 1
    return total


def usable_nodes(partition: Optional[str] = None) -> Optional[int]:
    """How many nodes of the partition can take a job now (not down, drained, failing); None if unknown."""
    nodes = partition_nodes(partition, fresh=True)
    if nodes is None:
        return None
    return sum(1 for n in nodes if not _UNUSABLE_NODE.match(n["state"]))


def stuck_on_down_nodes(reason: str, partition: Optional[str], nodes_needed: int) -> bool:
    """A pending job that cannot start because the nodes it needs are down or drained (not merely busy)."""
    if not _DOWN_REASON.search(reason or ""):
        return False
    usable = usable_nodes(partition)
    return usable is None or usable < nodes_needed


def epoch(stamp: Optional[str]) -> Optional[float]:
    """SLURM's `2026-12-01T10:14:46` (local time) -> epoch seconds; None for Unknown/None/empty."""
    if not stamp or not stamp[:1].isdigit():
        return None
    try:
        return time.mktime(time.strptime(stamp[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return None


def facts(
    rec: Optional[Dict[str, str]],
    sbatch_at: Optional[float],
    job_facts: Optional[Dict[str, Any]],
    task_at: Optional[float] = None,
) -> Dict:
    """The `slurm` block of a result once the job has ended: what the job recorded about itself, SLURM's final
    record, and the times: submit_to_start_s (SLURM's SubmitTime -> StartTime, whole seconds), sbatch_to_start_s
    (the sweep's sbatch call -> the batch script's first line on the node) and sbatch_to_task_s (-> dsexp's job
    code starting in the submitit process, `clock.task`: Python, submitit and Hydra started by then)."""
    out: Dict[str, Any] = dict(job_facts or {})
    rec = rec or {}
    if rec:
        out.update(
            state=rec.get("JobState") or None,
            reason=rec.get("Reason") if rec.get("Reason") not in (None, "", "None") else None,
            exit_code=rec.get("ExitCode") or None,
            nodelist=node_list(rec.get("NodeList")) or out.get("nodelist"),
            submit_time=rec.get("SubmitTime") or None,
            start_time=rec.get("StartTime") or None,
            end_time=rec.get("EndTime") or None,
            restarts=int(rec["Restarts"]) if str(rec.get("Restarts", "")).isdigit() else out.get("restart_count"),
            record_source=rec.get("Source"),
        )
        out.setdefault("job_id", _key(rec) or None)
        if not out.get("node") and rec.get("BatchHost"):
            out["node"] = rec["BatchHost"]
        if not out.get("node") and node_list(rec.get("NodeList")) and not any(c in rec["NodeList"] for c in "[,"):
            out["node"] = rec["NodeList"]
    submit, start = epoch(out.get("submit_time")), epoch(out.get("start_time"))
    allocated = bool(out.get("nodelist") or out.get("node"))  # a job cancelled while pending "starts" as it ends
    if submit is not None and start is not None and allocated:
        out["submit_to_start_s"] = start - submit
    if sbatch_at is not None:
        out["sbatch_at"] = sbatch_at
        if out.get("started_at"):
            out["sbatch_to_start_s"] = out["started_at"] - sbatch_at
        if task_at:
            out["sbatch_to_task_s"] = task_at - sbatch_at
    return out


def node_list(nodelist: Optional[str]) -> Optional[str]:
    """A node list, None for SLURM's "none yet" spellings."""
    return None if nodelist in (None, "", "(null)", "None assigned") else nodelist


def slurm_cause(state: Optional[str], error_text: str = "", deadline: Optional[str] = None) -> Optional[str]:
    """dsexp's cause for how SLURM ended a job, None when SLURM did not end it (it completed or failed by itself)."""
    if deadline:
        return "node_failed"
    if state in STATE_CAUSES:
        return STATE_CAUSES[state]
    if _SUBMITIT_TIMED_OUT.search(error_text or ""):
        return "time_limit"
    return None


def is_time_limit_error(e: BaseException) -> bool:
    """The exception submitit raises in the job when SLURM's USR2 comes near the time limit and the job is not
    requeued (`UncompletedJobError: Job not requeued because: timed-out too many times.`)."""
    return type(e).__name__ == "UncompletedJobError" and bool(_SUBMITIT_TIMED_OUT.search(str(e)))


_WHAT = {
    "slurm_cancelled": "SLURM cancelled the job (scancel, or preemption)",
    "node_failed": "the job's node failed (SLURM: NODE_FAIL)",
    "time_limit": "the job reached SLURM's time limit (hydra.launcher.timeout_min)",
    "oom_host": "SLURM killed the job for exceeding its memory (hydra.launcher.mem_gb)",
    "slurm_failed": "the SLURM job ended without a dsexp result",
}


def merge_outcome(
    result: Optional[Dict[str, Any]],
    slurm: Dict[str, Any],
    reached: Dict[str, Any],
    error_text: str = "",
    deadline: Optional[str] = None,
) -> Dict[str, Any]:
    """The job's result with SLURM's account of its end. `result`: what this attempt wrote (None if it wrote
    nothing); `reached`: the ranks' state from their files (failures.reached), used when the job could not
    record it. An ok result stays ok; a job SLURM ended becomes failed with SLURM's cause, keeping the job's own
    failure record (its cause as `job_cause`)."""
    result = dict(result or {})
    result["slurm"] = {**(result.get("slurm") or {}), **slurm}
    state = slurm.get("state")
    cause = slurm_cause(state, error_text, deadline)
    own = result.get("failure") or {}
    if result.get("status") == "ok":
        return result
    if cause is None and own.get("cause") not in (None, "interrupted"):
        return result  # the job failed for a reason of its own, and recorded it
    cause = cause or "slurm_failed"
    failure = {**own}
    if own.get("cause") and own.get("cause") != cause:
        failure["job_cause"] = own["cause"]
    for k, v in reached.items():
        if not failure.get(k):
            failure[k] = v
    where = ", ".join(f"{r} in {p}" for r, p in (failure.get("ranks_at_stop") or {}).items())
    if deadline:
        what = deadline
    else:
        what = _WHAT[cause] if cause in _WHAT else f"SLURM ended the job ({state})"
    detail = f"SLURM state {state or 'unknown'}" + (
        f", reason {slurm['reason']}" if slurm.get("reason") and not deadline else ""
    )
    failure.update(
        cause=cause,
        slurm_state=state,
        rank=failure.get("rank"),
        phase=failure.get("phase") or _first_phase(failure.get("ranks_at_stop")),
        message=f"{what}; {detail}"
        + (f"; ranks stopped at: {where}" if where else "; before any rank had started")
        + (f"; submitit: {_last_line(error_text)}" if error_text else ""),
    )
    failure.setdefault("type", "slurm")
    result.update(status="failed", failure=failure)
    return result


def _first_phase(at_stop: Optional[Dict[str, Optional[str]]]) -> Optional[str]:
    return next((p for p in (at_stop or {}).values() if p), None)


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in (text or "").splitlines() if ln.strip() and not ln.strip().startswith("-")]
    hits = [ln for ln in lines if "Error" in ln or "requeued" in ln or "state:" in ln]
    return (hits or lines or [""])[-1][:500]
