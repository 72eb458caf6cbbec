"""Background peak sampler: the highest host and NVML figures reached between two phase snapshots.

A daemon thread reads /proc (and NVML when there is a GPU) every `period_s`; `take()` returns the peaks since the
previous `take()` and starts a new window. Each reading is the process's RSS and its anonymous part (one read of
/proc/self/statm): what moves fastest. One reading in FULL_EVERY, and every `take()`, is full: it adds status's
file/shmem split, the node's used memory (/proc/meminfo) and NVML's device and per-process figures. NVML's figures
are the caching allocator's reserve plus what lies outside it: they fall only when memory is handed back
(empty_cache, a freed communicator), so a reading every FULL_EVERY periods and the one at each window's end catch
their peak; torch's own peaks (the phase records) catch the allocator's. The reason for the split: after each sleep
every kernel path and Python function runs cold. On the H200 a statm read costs 25-34 us of CPU cold (2 warm),
NVML's device query 73-101 (7-10), its process list 164-241 (27-35). Measured in one call
(results/h200/sampler_cost): the readings as they were (status, meminfo and NVML every 10 ms) 2.2% of a core,
NVML at full readings only 1.3%, and that at the default 20 ms period 0.7%. The rest is the wake-up itself, so the
period sets the cost. An optional `beat` callback gets the running window's peaks every `beat_s` (the rank's live
file). Without `start()` there is no thread: each window's peak is the reading `take()` makes at its end
(`probe.sample_ms=0`, for measuring what the sampler itself costs).

With a `series` (dsexp.rank.probes.memory_series) every reading also goes to the rank's memory-over-time series, with
the allocator's figures where `allocator` reads them (one reading in ALLOCATOR_EVERY and at every `take()`; they
are the series' only: the phase records carry torch's own peaks). Each reading is stamped when it is committed,
under the lock that assigns it to a window, and `take()` reads, commits and closes the window in one step: its
stamp (`closed_at`) is the window's end, and every reading of the window, in the peaks and in the series, lies
before.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Dict, Optional, Tuple

from dsexp.rank.probes.host import ProcFiles

FULL_EVERY = 5  # readings per full reading (RSS split, node, NVML)
# readings per allocator reading (the series' torch allocated/reserved): one call builds the allocator's whole stats
# dict, and run once a period the sampler's Python costs several times what it does warm
ALLOCATOR_EVERY = 10


class PeakSampler:
    def __init__(
        self,
        period_s: float = 0.01,
        nvml=None,
        beat: Optional[Callable[[Dict[str, int], Dict[str, int]], None]] = None,
        beat_s: float = 0.5,
        series=None,
    ):
        self.period_s = period_s
        self.nvml = nvml
        self.series = series
        self.allocator: Optional[Callable[[], Dict[str, int]]] = None  # GPU: torch's allocated/reserved now
        self.closed_at = time.perf_counter()  # stamp of the reading that closed the last window
        self.beat, self.beat_s = beat, beat_s
        self.last: Dict[str, int] = {}
        self._peaks: Dict[str, int] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.samples = 0
        self.cpu_s = 0.0
        self._proc = ProcFiles()

    def _read(self, at_end: bool) -> Tuple[Dict[str, int], Dict[str, int]]:
        """(readings with peaks, readings for the series only); at_end: the reading that closes a window."""
        vals = self._proc.read_rss()
        if at_end or self.samples % FULL_EVERY == 0:
            vals = {**self._proc.read(), **vals, **self._nvml_reading()}  # statm's RSS, as every reading has it
        extra = self._allocator_reading() if at_end or self.samples % ALLOCATOR_EVERY == 0 else {}
        return vals, extra

    def _nvml_reading(self) -> Dict[str, int]:
        if self.nvml is None:
            return {}
        vals = {"nvml_device_used": self.nvml.used(), "nvml_process_used": self.nvml.process_used()}
        return {k: v for k, v in vals.items() if v is not None}

    def _allocator_reading(self) -> Dict[str, int]:
        """The series' allocator figures; never raises (take() runs at every phase end, in the rank's thread)."""
        if self.allocator is None or self.series is None:
            return {}
        try:
            return self.allocator()
        except Exception:
            return {}

    def sample(self, at_end: bool = False) -> None:
        vals, extra = self._read(at_end)
        self.last.update(vals)  # the latest of each figure, the full reading's too (readers take a dict() copy)
        with self._lock:
            self._commit(vals, extra)

    def _commit(self, vals: Dict[str, int], extra: Dict[str, int]) -> float:
        """Count a reading into the open window (caller holds the lock); return its stamp."""
        stamp = time.perf_counter()
        for k, v in vals.items():
            if v > self._peaks.get(k, -1):
                self._peaks[k] = v
        self.samples += 1
        if self.series is not None:
            self.series.add(stamp, {**vals, **extra} if extra else vals)
        return stamp

    def _run(self) -> None:
        next_beat = time.monotonic()
        while not self._stop.is_set():
            c0 = time.thread_time()
            try:
                self.sample()
                if self.beat is not None and time.monotonic() >= next_beat:
                    next_beat = time.monotonic() + self.beat_s
                    self.beat(self.peek(), dict(self.last))
            except Exception:  # a probe must never kill the rank it observes
                pass
            self.cpu_s += time.thread_time() - c0
            self._stop.wait(self.period_s)

    def start(self) -> "PeakSampler":
        self._thread = threading.Thread(target=self._run, name="dsexp-sampler", daemon=True)
        self._thread.start()
        return self

    def peek(self) -> Dict[str, int]:
        """Peaks of the window so far, without closing it."""
        with self._lock:
            return {f"{k}_peak": v for k, v in self._peaks.items()}

    def take(self) -> Dict[str, int]:
        """Peaks of the window just ended (including a final, full read now); opens a new window. `closed_at`: the
        final reading's stamp."""
        vals, extra = self._read(at_end=True)
        self.last.update(vals)
        with self._lock:
            self.closed_at = self._commit(vals, extra)
            peaks, self._peaks = self._peaks, {}
            if self.series is not None:
                self.series.close_window()
        return {f"{k}_peak": v for k, v in peaks.items()}

    def stop(self) -> None:
        """End the thread (no further `take()`)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._thread is None or not self._thread.is_alive():
            self._proc.close()
