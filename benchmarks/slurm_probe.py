#!/usr/bin/env python3
"""Measure how SLURM's faults look from submitit on a throwaway cluster (the numbers in docs/notes-slurm.md).

    sudo make benchmark NAME=slurm_probe ARGS="--group basic --out /tmp/probe-basic.json"
    groups: basic (ok, ids, arrays, resources, submit-to-start), cancel, timeout, down, two_nodes

Each group starts its own cluster (tests/helpers/slurm_cluster.py) on its own ports and stops it at the end.
A scenario submits through `submitit.AutoExecutor(cluster="slurm")` (as hydra-submitit-launcher does),
waits for `job.result()` in a thread, polls SLURM (scontrol / jobcomp) and submitit (job.state, done())
every 0.5 s and records the changes, applies the fault, and reads the job's logs for signals and ticks.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "helpers"))
import slurm_cluster as sc  # noqa: E402
import submitit  # noqa: E402

ENV_KEYS = (
    "SLURM_JOB_ID",
    "SLURM_ARRAY_JOB_ID",
    "SLURM_ARRAY_TASK_ID",
    "SLURMD_NODENAME",
    "SLURM_JOB_NODELIST",
    "SLURM_NODEID",
    "SLURM_PROCID",
    "SLURM_LOCALID",
    "SLURM_NTASKS",
    "SLURM_JOB_NUM_NODES",
    "SLURM_CPUS_ON_NODE",
    "SLURM_CPUS_PER_TASK",
    "SLURM_MEM_PER_NODE",
    "SLURM_MEM_PER_CPU",
    "SLURM_JOB_PARTITION",
    "SLURM_CLUSTER_NAME",
    "SLURM_RESTART_COUNT",
    "SLURM_STEP_ID",
    "SLURM_CONF",
)


def sleeper(seconds: int) -> dict:
    import os
    import socket
    import time

    import submitit

    env = {k: os.environ.get(k) for k in ENV_KEYS if k in os.environ}
    env["hostname"] = socket.gethostname()
    env["JobEnvironment"] = repr(submitit.JobEnvironment())
    print(f"tick-start {time.time():.3f} {env}", flush=True)
    for _ in range(seconds):
        time.sleep(1)
        print(f"tick {time.time():.3f}", flush=True)
    return env


class CheckpointableSleeper(submitit.helpers.Checkpointable):
    """Like hydra-submitit-launcher's launcher: checkpoint() resubmits the same call."""

    def __call__(self, seconds: int) -> dict:
        return sleeper(seconds)


RAW = r"""#!/bin/bash
t() { date +%s.%N; }
for s in TERM USR2 CONT INT HUP; do trap "echo sig-$s \$(t)" $s; done
echo start $(t) $SLURM_JOB_ID $SLURMD_NODENAME
for i in $(seq 1 300); do sleep 1 & wait $!; echo tick $(t); done
"""


def short(text: str, n: int = 900) -> str:
    text = str(text)
    return text if len(text) <= n else text[: n // 2] + " [...] " + text[-n // 2 :]


class Probe:
    def __init__(self, cluster: sc.Cluster, base: Path):
        self.cluster = cluster
        self.base = base
        self.out: dict = {}

    def slurmd_pid(self, node: str) -> int:
        return next(p["pid"] for p in self.cluster.processes if p["name"] == f"slurmd-{node}")

    def ensure_idle(self, timeout=60):
        """Bring back nodes a previous scenario left down/drained, wait until all are idle."""
        deadline = time.time() + timeout
        while True:
            states = self.cluster.node_states()
            if states and all(s == "idle" for s in states.values()):
                return
            for node, state in states.items():
                if state.startswith(("down", "drain")):
                    self.cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
            if time.time() > deadline:
                raise RuntimeError(f"nodes not idle: {states}")
            time.sleep(1)

    def submitit_job(
        self,
        name: str,
        fn,
        args=(),
        params=None,
        action=None,
        action_after=5.0,
        undo_after=None,
        deadline=240.0,
        max_num_timeout=3,
        env_path=None,
    ):
        self.ensure_idle()
        folder = self.base / name
        saved_path = os.environ["PATH"]
        if env_path is not None:
            os.environ["PATH"] = env_path
        ex = submitit.AutoExecutor(folder=folder, cluster="slurm", slurm_max_num_timeout=max_num_timeout)
        ex.update_parameters(**(params or {}))
        t0 = time.time()
        job = ex.submit(fn, *args)
        res: dict = {}

        def waiter():
            try:
                res.update(outcome="ok", value=job.results() if job.num_tasks > 1 else job.result())
            except BaseException as e:  # noqa: BLE001 - record whatever submitit raises
                res.update(outcome=f"{type(e).__module__}.{type(e).__name__}", message=str(e))
            res["t"] = round(time.time() - t0, 1)

        th = threading.Thread(target=waiter, daemon=True)
        th.start()
        timeline, last, acted, undone, started = [], None, None, None, None
        ended_at = None
        while time.time() - t0 < deadline:
            rec = self.cluster.job_record(job.job_id) or {}
            out = job.paths.stdout.read_text(errors="replace") if job.paths.stdout.exists() else ""
            if started is None and "tick-start" in out:
                started = time.time()
            state = (
                rec.get("JobState"),
                rec.get("Reason"),
                rec.get("Restarts"),
                rec.get("NodeList"),
                job.watcher.get_state(job.job_id, mode="cache"),
                job.done(),
            )
            if state != last:
                timeline.append(
                    {
                        "t": round(time.time() - t0, 1),
                        "slurm": state[0],
                        "reason": state[1],
                        "restarts": state[2],
                        "nodes": state[3],
                        "submitit_state": state[4],
                        "done": state[5],
                    }
                )
                last = state
            if action and acted is None and started and time.time() - started >= action_after:
                acted = time.time()
                node = rec.get("NodeList")
                if action == "scancel":
                    self.cluster.run("scancel", job.job_id)
                elif action == "preempt":  # what submitit's job._interrupt() does: TERM, then USR2
                    job._interrupt()
                elif action == "down":
                    self.cluster.run("scontrol", "update", f"nodename={node}", "state=down", "reason=test")
                elif action == "stop_slurmd":
                    os.kill(self.slurmd_pid(node), signal.SIGSTOP)
                timeline.append({"t": round(acted - t0, 1), "action": action, "node": node})
                self._acted_node = node
            if acted and undo_after is not None and undone is None and time.time() - acted >= undo_after:
                undone = time.time()
                self._undo(action)
                timeline.append({"t": round(undone - t0, 1), "action": f"undo {action}"})
            if not th.is_alive() and rec.get("JobState") in sc.TERMINAL_STATES:
                ended_at = ended_at or time.time()
                if time.time() - ended_at > 2:
                    break
            time.sleep(0.5)
        if acted and undo_after is not None and undone is None:
            self._undo(action)
            timeline.append({"t": round(time.time() - t0, 1), "action": f"undo {action} (at the end)"})
        if th.is_alive():
            res.update(
                outcome=f"no result after {deadline:.0f}s (job.result() still waiting)",
                submitit_state=job.state,
                done=job.done(),
            )
        if env_path is not None:
            os.environ["PATH"] = saved_path
        rec = self.cluster.job_record(job.job_id) or {}
        if rec.get("JobState") not in sc.TERMINAL_STATES:
            self.cluster.run("scancel", job.job_id, check=False)
            time.sleep(2)
        entry = {
            "job_id": job.job_id,
            "params": params,
            "fn": getattr(fn, "__name__", type(fn).__name__),
            "started_after_s": round(started - t0, 1) if started else None,
            "action_at_s": round(acted - t0, 1) if acted else None,
            "result": {k: (short(v) if k == "message" else v) for k, v in res.items()},
            "timeline": timeline,
            "slurm_record": {
                k: rec.get(k)
                for k in (
                    "JobState",
                    "Reason",
                    "Restarts",
                    "ExitCode",
                    "NodeList",
                    "SubmitTime",
                    "EligibleTime",
                    "StartTime",
                    "EndTime",
                    "Requeue",
                    "TimeLimit",
                    "Source",
                )
            },
            "jobcomp_lines": [ln.strip() for ln in self._jobcomp(job.job_id)],
            "stdout": self._summarise(job.paths.stdout),
            "stderr_signals": self._signal_lines(job.paths.stderr),
            "sacct_shim": self.cluster.run(
                "sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", job.job_id.split("_")[0], check=False
            ).stdout.strip(),
            "wall_s": round(time.time() - t0, 1),
        }
        self.out[name] = entry
        print(json.dumps({name: entry}, indent=1, default=str), flush=True)
        return entry

    def _undo(self, action):
        node = getattr(self, "_acted_node", None)
        if action == "down":
            self.cluster.run("scontrol", "update", f"nodename={node}", "state=resume", check=False)
        elif action == "stop_slurmd":
            os.kill(self.slurmd_pid(node), signal.SIGCONT)

    def _jobcomp(self, job_id):
        raw = {r.get("JobId") for r in self.cluster.job_records(job_id.split("_")[0])}
        try:
            lines = self.cluster.jobcomp.read_text().splitlines()
        except OSError:
            return []
        return [ln for ln in lines if sc.parse_record(ln).get("JobId") in raw]

    @staticmethod
    def _summarise(path: Path) -> dict:
        if not path.exists():
            return {"exists": False}
        lines = path.read_text(errors="replace").splitlines()
        ticks = [float(ln.split()[1]) for ln in lines if ln.startswith("tick ")]
        starts = [ln for ln in lines if ln.startswith("tick-start")]
        return {
            "starts": len(starts),
            "first_start": short(starts[0], 1200) if starts else None,
            "first_start_t": float(starts[0].split()[1]) if starts else None,
            "last_tick_t": ticks[-1] if ticks else None,
            "ticks": len(ticks),
        }

    @staticmethod
    def _signal_lines(path: Path) -> list:
        if not path.exists():
            return []
        keep = re.compile(r"signal|Bypass|requeue|Requeue|timed|Exiting|CANCELLED|DUE TO|error|Error|srun:")
        return [short(ln, 300) for ln in path.read_text(errors="replace").splitlines() if keep.search(ln)][:40]

    def raw_job(self, name: str, sbatch_args, action=None, action_after=5.0, deadline=200.0):
        script = self.base / f"{name}.sh"
        script.parent.mkdir(parents=True, exist_ok=True)
        script.write_text(RAW)
        outf = self.base / f"{name}.out"
        t0 = time.time()
        jid = self.cluster.sbatch(f"--output={outf}", *sbatch_args, str(script))
        acted, timeline, last = None, [], None
        while time.time() - t0 < deadline:
            rec = self.cluster.job_record(jid) or {}
            st = (rec.get("JobState"), rec.get("Reason"))
            if st != last:
                timeline.append({"t": round(time.time() - t0, 1), "slurm": st[0], "reason": st[1]})
                last = st
            text = outf.read_text() if outf.exists() else ""
            if action and acted is None and "start" in text:
                if time.time() - t0 >= action_after:
                    acted = time.time()
                    self.cluster.run("scancel", jid)
                    timeline.append({"t": round(acted - t0, 1), "action": action})
            if rec.get("JobState") in sc.TERMINAL_STATES:
                break
            time.sleep(0.5)
        time.sleep(1)
        rec = self.cluster.job_record(jid) or {}
        lines = outf.read_text().splitlines() if outf.exists() else []
        start = next((float(ln.split()[1]) for ln in lines if ln.startswith("start ")), None)
        sigs = [(ln.split()[0], round(float(ln.split()[1]) - start, 2)) for ln in lines if ln.startswith("sig-")]
        ticks = [float(ln.split()[1]) for ln in lines if ln.startswith("tick ")]
        entry = {
            "job_id": jid,
            "sbatch": list(sbatch_args),
            "timeline": timeline,
            "signals_s_after_start": sigs,
            "last_tick_s_after_start": round(ticks[-1] - start, 2) if ticks else None,
            "scancel_s_after_start": round(acted - start, 2) if acted and start else None,
            "slurm_record": {
                k: rec.get(k)
                for k in ("JobState", "Reason", "ExitCode", "SubmitTime", "StartTime", "EndTime", "TimeLimit", "Source")
            },
            "other_lines": [ln for ln in lines if not ln.startswith(("tick", "sig-", "start"))][:10],
        }
        self.out[name] = entry
        print(json.dumps({name: entry}, indent=1, default=str), flush=True)

    def resources(self):
        cases = {
            "gpus_per_node=1": ["--gpus-per-node=1"],
            "gres=gpu:1": ["--gres=gpu:1"],
            "gpus=1": ["--gpus=1"],
            "cpus_per_task=2": ["--cpus-per-task=2"],
            "cpus_per_task=3": ["--cpus-per-task=3"],
            "mem=23G": ["--mem=23G"],
            "mem=24105M": ["--mem=24105M"],
            "mem=24106M": ["--mem=24106M"],
            "mem=30G": ["--mem=30G"],
            "mem=0 (whole node)": ["--mem=0"],
            "exclusive": ["--exclusive"],
            "nodes=2 on one node": ["--nodes=2"],
            "time=1": ["--time=1"],
            "mem_per_cpu=13000": ["--mem-per-cpu=13000"],
            "ntasks=2": ["--ntasks=2"],
            "ntasks=3": ["--ntasks=3"],
        }
        out = {}
        for name, args in cases.items():
            t0 = time.time()
            proc = self.cluster.run("sbatch", "--parsable", "-o", "/dev/null", *args, "--wrap", "sleep 1", check=False)
            entry = {"rc": proc.returncode, "stderr": proc.stderr.strip(), "submit_s": round(time.time() - t0, 2)}
            if proc.returncode == 0:
                jid = proc.stdout.strip()
                time.sleep(4)
                rec = self.cluster.job_record(jid) or {}
                entry.update(
                    state_after_4s=rec.get("JobState"),
                    reason=rec.get("Reason"),
                    tres=rec.get("TRES"),
                    mem_per=rec.get("MinMemoryNode") or rec.get("MinMemoryCPU"),
                )
                self.cluster.run("scancel", jid, check=False)
            out[name] = entry
        # the same through submitit
        ex = submitit.AutoExecutor(folder=self.base / "resources", cluster="slurm")
        ex.update_parameters(gpus_per_node=1, timeout_min=5)
        try:
            job = ex.submit(sleeper, 1)
            out["submitit gpus_per_node=1"] = {"submitted": job.job_id}
            self.cluster.run("scancel", job.job_id, check=False)
        except Exception as e:  # noqa: BLE001
            out["submitit gpus_per_node=1"] = {
                "exception": f"{type(e).__module__}.{type(e).__name__}",
                "message": short(str(e), 600),
            }
        self.out["resources"] = out
        print(json.dumps({"resources": out}, indent=1), flush=True)

    def submit_to_start(self, n=8):
        rows = []
        for i in range(n):
            outf = self.base / f"sts-{i}.out"
            t0 = time.time()
            jid = self.cluster.sbatch(f"--output={outf}", "--wrap", "date +%s.%N")
            t_sb = time.time()
            rec = self.cluster.wait_final(jid, timeout=60)
            began = float(outf.read_text().split()[0])
            rows.append(
                {
                    "job": jid,
                    "sbatch_s": round(t_sb - t0, 3),
                    "wall_submit_to_run_s": round(began - t0, 3),
                    "SubmitTime": rec["SubmitTime"],
                    "StartTime": rec["StartTime"],
                    "EndTime": rec["EndTime"],
                    "slurm_start_minus_submit_s": _secs(rec["StartTime"]) - _secs(rec["SubmitTime"]),
                }
            )
            time.sleep(0.3)
        # four at once (2 CPUs: two run, two wait for a free core)
        t0 = time.time()
        ids = [self.cluster.sbatch("-o", "/dev/null", "--wrap", "sleep 2") for _ in range(4)]
        recs = [self.cluster.wait_final(j, timeout=60) for j in ids]
        burst = [
            {"job": j, "start_minus_submit_s": _secs(r["StartTime"]) - _secs(r["SubmitTime"])}
            for j, r in zip(ids, recs)
        ]
        # an array of 4 (what dsexp's launcher submits)
        aid = self.cluster.sbatch("-o", "/dev/null", "--array=0-3", "--wrap", "sleep 1")
        time.sleep(1)
        for _ in range(60):
            recs = self.cluster.job_records(aid)
            if len(recs) == 4 and all(r.get("JobState") in sc.TERMINAL_STATES for r in recs):
                break
            time.sleep(1)
        array = [
            {
                "task": sc._key(r),
                "start_minus_submit_s": _secs(r["StartTime"]) - _secs(r["SubmitTime"]),
                "eligible_minus_submit_s": _secs(r["EligibleTime"]) - _secs(r["SubmitTime"]),
            }
            for r in recs
        ]
        self.out["submit_to_start"] = {
            "sequential": rows,
            "burst_of_4": burst,
            "array_of_4": array,
            "wall_total_s": round(time.time() - t0, 1),
        }
        print(json.dumps({"submit_to_start": self.out["submit_to_start"]}, indent=1), flush=True)

    def array(self):
        ex = submitit.AutoExecutor(folder=self.base / "array", cluster="slurm")
        ex.update_parameters(timeout_min=5)
        t0 = time.time()
        jobs = ex.map_array(sleeper, [2, 2, 2])
        results = [j.result() for j in jobs]
        self.out["array"] = {
            "job_ids": [j.job_id for j in jobs],
            "wall_s": round(time.time() - t0, 1),
            "envs": [
                {
                    k: r.get(k)
                    for k in (
                        "SLURM_JOB_ID",
                        "SLURM_ARRAY_JOB_ID",
                        "SLURM_ARRAY_TASK_ID",
                        "SLURMD_NODENAME",
                        "JobEnvironment",
                    )
                }
                for r in results
            ],
            "states": [j.state for j in jobs],
            "sacct_shim": self.cluster.run(
                "sacct", "-o", "JobID,State,NodeList", "--parsable2", "-j", jobs[0].job_id.split("_")[0]
            ).stdout.strip(),
        }
        print(json.dumps({"array": self.out["array"]}, indent=1), flush=True)


def _secs(ts: str) -> int:
    return int(time.mktime(time.strptime(ts, "%Y-%m-%dT%H:%M:%S")))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--group", required=True, choices=("basic", "cancel", "timeout", "down", "two_nodes"))
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--port", type=int, default=None)
    ap.add_argument("--only", default="")
    ap.add_argument("--tag", default="")
    ap.add_argument("--cred-expire", type=int, default=None, help="AuthInfo cred_expire (script default otherwise)")
    args = ap.parse_args()
    ports = {"basic": 16817, "cancel": 16827, "timeout": 16837, "down": 16847, "two_nodes": 16857}
    base = Path(f"/tmp/slurm-probe-{args.group}{args.tag}")
    timing = {"cred_expire": args.cred_expire} if args.cred_expire else None
    nodes = 2 if args.group == "two_nodes" else 1
    only = set(filter(None, args.only.split(",")))
    with sc.start_cluster(base / "cluster", nodes=nodes, port=args.port or ports[args.group], timing=timing) as cluster:
        os.environ.update(cluster.env_vars)
        p = Probe(cluster, base / "jobs")
        p.out["cluster"] = {
            "conf": cluster.conf.read_text(),
            "nodes": cluster.node_states(),
            "scontrol_show_node": cluster.run("scontrol", "show", "node", "-o").stdout.strip(),
        }
        no_shim = os.pathsep.join(x for x in os.environ["PATH"].split(os.pathsep) if x != str(cluster.dir / "bin"))
        t5 = {"timeout_min": 5}

        def want(name):
            return not only or name in only

        if args.group == "basic":
            want("ok") and p.submitit_job("ok", sleeper, (3,), t5, deadline=60)
            want("array") and p.array()
            want("submit_to_start") and p.submit_to_start()
            want("resources") and p.resources()
        elif args.group == "cancel":
            want("scancel") and p.submitit_job("scancel", sleeper, (120,), t5, action="scancel", deadline=120)
            want("scancel_no_sacct") and p.submitit_job(
                "scancel_no_sacct", sleeper, (120,), t5, action="scancel", deadline=90, env_path=no_shim
            )
            want("raw_scancel") and p.raw_job("raw_scancel", ["--time=5"], action="scancel", deadline=60)
            want("preempt") and p.submitit_job(
                "preempt", CheckpointableSleeper(), (20,), {"timeout_min": 30}, action="preempt", deadline=300
            )
        elif args.group == "timeout":
            want("timeout_plain") and p.submitit_job("timeout_plain", sleeper, (200,), {"timeout_min": 1}, deadline=200)
            want("timeout_ckpt0") and p.submitit_job(
                "timeout_ckpt0", CheckpointableSleeper(), (200,), {"timeout_min": 1}, max_num_timeout=0, deadline=200
            )
            want("timeout_nosignal") and p.submitit_job(
                "timeout_nosignal", sleeper, (200,), {"timeout_min": 1, "slurm_signal_delay_s": 0}, deadline=200
            )
            want("raw_timeout") and p.raw_job("raw_timeout", ["--time=1", "--signal=B:USR2@30"], deadline=200)
            want("timeout_ckpt1") and p.submitit_job(
                "timeout_ckpt1", CheckpointableSleeper(), (200,), {"timeout_min": 1}, max_num_timeout=1, deadline=480
            )
        elif args.group == "down":
            want("down") and p.submitit_job("down", sleeper, (40,), t5, action="down", undo_after=60, deadline=330)
            want("down_norequeue") and p.submitit_job(
                "down_norequeue",
                sleeper,
                (40,),
                {**t5, "slurm_additional_parameters": {"no-requeue": True}},
                action="down",
                undo_after=30,
                deadline=150,
            )
            want("stop_slurmd") and p.submitit_job(
                "stop_slurmd", sleeper, (150,), t5, action="stop_slurmd", undo_after=90, deadline=330
            )
            want("stop_slurmd_norequeue") and p.submitit_job(
                "stop_slurmd_norequeue",
                sleeper,
                (150,),
                {**t5, "slurm_additional_parameters": {"no-requeue": True}},
                action="stop_slurmd",
                undo_after=70,
                deadline=200,
            )
            want("preempt_norequeue") and p.submitit_job(
                "preempt_norequeue",
                CheckpointableSleeper(),
                (20,),
                {"timeout_min": 30, "slurm_additional_parameters": {"no-requeue": True}},
                action="preempt",
                deadline=120,
            )
        elif args.group == "two_nodes":
            want("two_nodes") and p.submitit_job(
                "two_nodes", sleeper, (2,), {**t5, "nodes": 2, "tasks_per_node": 1}, deadline=60
            )
            want("down_other_node") and p.submitit_job(
                "down_other_node", sleeper, (30,), t5, action="down", undo_after=200, deadline=330
            )
        p.out["slurmctld_log_tail"] = sc._tail(cluster.dir / "log" / "slurmctld.log", 60)
        args.out.write_text(json.dumps(p.out, indent=1, default=str))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
