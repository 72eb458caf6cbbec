"""Per-phase recording for one rank: wall time, end-of-phase snapshots, in-phase peaks.

The rank file is rewritten after every phase, so a rank that is killed mid-run still leaves the
memory it reached up to its last completed phase (plus the peaks the failing phase saw, when the
failure is an exception). While a phase runs, a small live file (`rank{N}.live.json`) is rewritten
about twice a second with the phase's peaks so far and a timestamp: after a hard death (SIGKILL,
os._exit, the OOM killer) it holds the partial measurement of the phase the rank died in and
when it was last alive.

Timeline times are seconds after `clock.t0` (epoch seconds: the worker's first line ran then); `clock.created`
is when the process was created and `clock.finished` when the record was complete, so the job can place a
rank's start-up and exit on its own clock. A phase's t0 and t1 are the stamps of the sampler's readings that
open and close its peak window, so the phase's peaks come from readings within [t0, t1].

The rank's memory over time (dsexp.rank.probes.memory_series) goes to `rank{N}.series.jsonl`, flushed with the live
file and the rank file, so a rank that dies keeps its curve up to its last heartbeat. On a GPU with
`memory_snapshot`, every phase end also dumps a PyTorch memory snapshot (dsexp.rank.probes.snapshots), after
the phase's own readings, and lists it in the phase's record.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Dict, Optional

from dsexp.core.cpu import features as cpu_features
from dsexp.core.fs import write_json_atomic
from dsexp.core.protocol import live_file, rank_file
from dsexp.core.records import phase_kind
from dsexp.core.series import GPU_FIELDS, HOST_FIELDS, series_file
from dsexp.rank.probes import gpu as gpu_probe
from dsexp.rank.probes.failure_site import failure_site
from dsexp.rank.probes.host import host_snapshot, process_started
from dsexp.rank.probes.memory_series import MemorySeries
from dsexp.rank.probes.sampler import PeakSampler
from dsexp.rank.probes.snapshots import MemorySnapshots


class PhaseRecorder:
    def __init__(
        self,
        job_dir: Path,
        rank: int,
        world_size: int,
        local_rank: int,
        t_process: float,
        sample_ms: float = 20.0,
        see_memory_usage: bool = True,
        nvidia_smi: bool = False,
        memory_snapshot: Optional[Dict[str, int]] = None,
    ):
        """memory_snapshot: {"max_entries", "max_bytes"} to dump PyTorch memory snapshots on a GPU, else None."""
        self.job_dir, self.rank = Path(job_dir), rank
        self.path = rank_file(job_dir, rank)
        self.live_path = live_file(job_dir, rank)
        self.current: Optional[tuple] = None  # (phase name, its perf_counter start)
        self._split: Dict[str, int] = {}  # peaks of the windows closed inside the running phase (split_window)
        self._split_gpu: Dict[str, int] = {}  # torch's peaks of those windows
        self.align: Optional[Callable[[], None]] = None  # once the process group is up: a barrier over all ranks
        self._waited: Optional[float] = None
        self.t_process = t_process
        self.cuda_index: Optional[int] = None
        self.nvml = None
        self.snapshots: Optional[MemorySnapshots] = None
        self.opts = {"see_memory_usage": see_memory_usage, "nvidia_smi": nvidia_smi, "memory_snapshot": memory_snapshot}
        clock_t0 = time.time() - (time.perf_counter() - t_process)
        path = series_file(job_dir, rank)
        self.series = MemorySeries(path, rank, clock_t0, t_process, HOST_FIELDS, sample_ms / 1000.0)
        self.sampler = PeakSampler(sample_ms / 1000.0, beat=self._beat, series=self.series)
        if sample_ms > 0:  # 0: no background thread (peaks are the phase-end readings)
            self.sampler.start()
        self.record: Dict[str, Any] = {
            "rank": rank,
            "local_rank": local_rank,
            "world_size": world_size,
            "pid": os.getpid(),
            "hostname": socket.gethostname(),
            "slurm_node": os.environ.get("SLURMD_NODENAME"),  # the SLURM node (several slurmd may share a host)
            "cpu": cpu_features(),  # its vector instruction sets: a kernel built for one it lacks dies of SIGILL
            "device": "cpu",
            "status": "running",
            "phases": {},
            "timeline": [],
            "error": None,
            # the rendezvous endpoint names DeepSpeed's CPU shared-memory segments (the job removes them)
            "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}",
            "clock": {"t0": clock_t0, "created": process_started()},
            "series": {"file": str(path.relative_to(self.job_dir))},
        }
        self.flush()

    def attach_cuda(self, index: int) -> None:
        """Once torch is imported on a GPU rank: watch this device through NVML too."""
        self.cuda_index = index
        self.nvml = gpu_probe.NvmlDevice(index)
        self.sampler.nvml = self.nvml
        self.record["device"] = f"cuda:{index}"
        self.record["gpu_uuid"] = self.nvml.uuid
        self.series.set_fields(HOST_FIELDS + GPU_FIELDS)
        self.sampler.allocator = lambda: gpu_probe.allocator_reading(index)
        if self.opts["memory_snapshot"]:
            self._start_snapshots(self.opts["memory_snapshot"])

    @contextlib.contextmanager
    def phase(self, name: str, t0: Optional[float] = None):
        """Measure one phase; an exception is recorded (type, message, traceback) and re-raised."""
        key = self.begin(name, t0)
        try:
            yield self
        except BaseException as e:
            self.end(key, error=e)
            raise
        else:
            self.end(key)

    def begin(self, name: str, t0: Optional[float] = None, align: bool = True) -> str:
        """Open a phase (hooks call this where a library call starts); return its key: the name, or `name_<n>` for
        its n-th occurrence, so a phase that happens twice is kept twice. align=False: no barrier (a user's
        script may make a call on some ranks only, and a barrier there would deadlock)."""
        key = self.key_for(name)
        if self.cuda_index is not None:
            gpu_probe.reset_torch_peaks(self.cuda_index)
        if t0 is None:
            t0 = self._enter(key, align)
        self.current = (key, t0)
        self._beat(self.sampler.peek(), dict(self.sampler.last))  # a rank killed right away still shows the phase
        return key

    def end(self, key: str, error: Optional[BaseException] = None) -> None:
        """Close the phase `begin` opened (with the exception it ended with, if any)."""
        name, t0 = self.current if self.current and self.current[0] == key else (key, time.perf_counter())
        self._end(name, t0, error=error)  # `current` stays: the live file names the last phase until the next

    def key_for(self, name: str) -> str:
        n = sum(1 for e in self.record["timeline"] if e.get("kind", e["phase"]) == name) + 1
        return name if n == 1 else f"{name}_{n}"

    def _enter(self, name: str, align: bool = True) -> float:
        """A phase's start: wait for every rank (`align`), close the gap's peak window; return the phase's t0.

        Without the wait, a rank that finished the previous phase first would count, in its next phase, the time
        the others still spent on theirs and on their probes (DeepSpeed's see_memory_usage runs gc.collect on
        rank 0 only): its first collective waits for them."""
        if self.align is not None and align:
            self.current = (name, time.perf_counter())
            t = time.perf_counter()
            try:
                self.align()
            except BaseException as e:
                self._end(name, t, error=e)
                raise
            self._waited = time.perf_counter() - t
        self.sampler.take()  # discard the gap between phases
        self._split, self._split_gpu = {}, {}
        return self.sampler.closed_at

    def split_window(self) -> Dict[str, int]:
        """Close the peak windows inside the running phase (a prefill's end): the sampler's peaks and, on a GPU,
        torch's allocated/reserved peaks since the phase began or the last split (then reset: no synchronize, the
        allocator counts on the host). The phase's own figures still cover the whole phase."""
        peaks = self.sampler.take()
        torch_peaks = gpu_probe.take_torch_peaks(self.cuda_index) if self.cuda_index is not None else {}
        for k, v in peaks.items():
            self._split[k] = max(v, self._split.get(k, v))
        for k, v in torch_peaks.items():
            self._split_gpu[k] = max(v, self._split_gpu.get(k, v))
        return {**peaks, **torch_peaks}

    def _end(self, name: str, t0: float, error: Optional[BaseException] = None) -> None:
        peaks = self.sampler.take()
        for k, v in self._split.items():
            peaks[k] = max(v, peaks.get(k, v))
        split_gpu, self._split, self._split_gpu = self._split_gpu, {}, {}
        t1 = self.sampler.closed_at
        phase: Dict[str, Any] = {"wall_s": t1 - t0, "peaks": peaks, "host": host_snapshot()}
        if self._waited is not None:
            phase["wait_s"], self._waited = self._waited, None
        if self.cuda_index is not None:
            with contextlib.suppress(Exception):
                phase["gpu"] = gpu_probe.torch_snapshot(self.cuda_index)
                for k, v in split_gpu.items():  # peaks of windows split_window closed within the phase
                    phase["gpu"][k] = max(v, phase["gpu"].get(k, v))
                phase["gpu"]["nvml_device_used"] = self.nvml.used()
                phase["gpu"]["nvml_process_used"] = self.nvml.process_used()
            if self.opts["nvidia_smi"]:
                phase["nvidia_smi"] = gpu_probe.nvidia_smi(self.nvml.uuid)
        if self.snapshots is not None:
            phase["memory_snapshot"] = self._dump_snapshot(name)
        if self.opts["see_memory_usage"] and error is None:
            with contextlib.suppress(Exception):
                from dsexp.rank.probes.see_memory import capture

                phase["see_memory_usage"] = capture(f"dsexp: after {name}")
        self.record["phases"][name] = phase
        kind = phase_kind(name)
        self.record["timeline"].append(
            {"phase": name, "kind": kind, "t0": t0 - self.t_process, "t1": t1 - self.t_process}
        )
        if error is not None:
            self.record["error"] = {
                "phase": name,
                "type": type(error).__name__,
                "message": str(error)[:2000],
                "traceback": traceback.format_exc()[-4000:],
                "time": time.time(),
                "site": failure_site(error),  # the model's module it came from, if any
            }
            self.record["status"] = "failed"
        self.flush()

    def _beat(self, peaks: Dict[str, int], last: Dict[str, int]) -> None:
        """Called from the sampler thread: the running phase's peaks so far and the latest readings."""
        name, t0 = self.current or (None, self.t_process)
        write_json_atomic(
            self.live_path,
            {"phase": name, "elapsed_s": time.perf_counter() - t0, "time": time.time(), "peaks": peaks, "host": last},
            fsync=False,
        )
        self.series.flush()

    def _start_snapshots(self, options: Dict[str, int]) -> None:
        """Record the allocator's history from now on; a torch that cannot is noted in the record, not fatal."""
        snapshots = MemorySnapshots(self.job_dir, self.rank, options["max_entries"], options["max_bytes"])
        try:
            snapshots.start()
        except Exception as e:
            self.record["memory_snapshot_error"] = f"{type(e).__name__}: {e}"[:500]
        else:
            self.snapshots = snapshots

    def _dump_snapshot(self, name: str) -> Dict[str, Any]:
        try:
            return self.snapshots.dump(name)
        except Exception as e:  # a probe must never fail the phase it observes
            return {"error": f"{type(e).__name__}: {e}"[:500]}

    def note(self, **fields: Any) -> None:
        self.record.update(fields)
        self.flush()

    def annotate_phase(self, name: str, **fields: Any) -> None:
        self.record["phases"].setdefault(name, {}).update(fields)
        self.flush()

    def finish(self, **fields: Any) -> None:
        self.record.update(fields)
        self.sampler.take()  # the series' last point: the rank's end, not its last change
        self.sampler.stop()
        if self.snapshots is not None:
            self.snapshots.stop()
        self.record["sampler"] = {
            "samples": self.sampler.samples,
            "cpu_s": self.sampler.cpu_s,
            "period_s": self.sampler.period_s,
        }
        self.record["series"].update(self.series.stats())
        if self.record["status"] == "running":
            self.record["status"] = "ok"
        self.record["clock"]["finished"] = time.time()
        self.flush()

    def flush(self) -> None:
        self.series.flush()
        write_json_atomic(self.path, self.record)
