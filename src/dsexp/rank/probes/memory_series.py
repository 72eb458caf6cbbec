"""A rank's memory over time, kept small: the sampler's readings, thinned where nothing changes.

The sampler hands every reading to `add` and closes a window (`close_window`) where it closes its peak window
(phase boundaries). `add` only queues the reading; the queue is worked through in one batch at every heartbeat
(`flush`) and window end: run once a sampler period, the same Python costs the sampler's thread several times more
(its code and data are cold after each sleep: ~35 us against ~4 us a reading in a batch, `make bench`).

A reading is kept when a value moved by more than MOVE_REL of itself (at least MOVE_ABS) since the last kept one,
or when MAX_GAP_S passed; and when a window closes, the reading that held each field's highest value in it is kept
too, pinned, with the window's closing reading: the series' maximum of a field within a phase is the phase's
sampled peak. Beyond `max_points` the series is coarsened: every other unpinned point goes, and from then on kept
points are spaced twice as far apart (`level` + 1), so its length stays bounded however long the rank runs. The
file (dsexp.core.series) is appended at every heartbeat and phase end, rewritten only after a coarsening or a
change of fields.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from dsexp.core.fs import write_text_atomic
from dsexp.core.series import header_line, row_line

MAX_POINTS = 2000
MOVE_REL, MOVE_ABS = 0.002, 2**20  # a move smaller than 0.2% of the value or 1 MiB is no change
MAX_GAP_S = 1.0
QUEUE_MAX = 200  # readings queued at most (4 s at 20 ms; a heartbeat drains them every 0.5 s)


class _Point:
    __slots__ = ("t", "vals", "kept", "pinned")

    def __init__(self, t: float, vals: tuple):
        self.t, self.vals, self.kept, self.pinned = t, vals, False, False


class MemorySeries:
    def __init__(
        self,
        path: Path,
        rank: int,
        clock_t0: float,
        t_origin: float,
        fields: Sequence[str],
        period_s: float,
        max_points: int = MAX_POINTS,
    ):
        """t_origin: the perf_counter value of clock.t0 (times are kept as seconds after it)."""
        self.path, self.rank, self.clock_t0, self.t_origin = Path(path), rank, clock_t0, t_origin
        self.fields = tuple(fields)
        self.period_s, self.max_points = period_s, max_points
        self.level, self.peaks_kept = 0, True
        self._points: List[_Point] = []
        self._best: List[Optional[_Point]] = [None] * len(self.fields)  # the window's highest reading per field
        self._latest: Optional[_Point] = None
        self._ref: List[Optional[int]] = [None] * len(self.fields)  # each field's value in the last kept point
        self._last_t: Optional[float] = None
        self._pending: List[_Point] = []
        self._queue: List[tuple] = []  # readings (stamp, values) not worked through yet
        self._rewrite = True
        self._lock = threading.Lock()

    # --- readings (the sampler's thread and, at window ends, the main thread) ---

    def add(self, stamp: float, vals: Dict[str, int]) -> None:
        with self._lock:
            self._queue.append((stamp, vals))
            if len(self._queue) >= QUEUE_MAX:  # no heartbeat drains it (a sampler without one)
                self._drain()

    @property
    def points(self) -> List[_Point]:
        with self._lock:
            self._drain()
            return self._points

    def _drain(self) -> None:
        """Work through the queued readings (caller holds the lock)."""
        queue, self._queue = self._queue, []
        for stamp, vals in queue:
            self._take_in(stamp, vals)

    def _take_in(self, stamp: float, vals: Dict[str, int]) -> None:
        p = _Point(stamp - self.t_origin, tuple(vals.get(f) for f in self.fields))
        self._latest = p
        for i, v in enumerate(p.vals):
            if v is not None and (self._best[i] is None or v > self._best[i].vals[i]):
                self._best[i] = p
        if self._due(p):
            self._keep(p)
            if len(self._points) > self.max_points:
                self._coarsen()

    def close_window(self) -> None:
        """The sampler closed its peak window: keep and pin each field's highest reading and the closing one."""
        with self._lock:
            self._drain()
            ends = [p for p in (*self._best, self._latest) if p is not None]
            late = False
            for p in ends:
                if not p.kept:
                    late = late or bool(self._points) and p.t < self._points[-1].t
                    self._keep(p)
                p.pinned = True
            if late:  # a peak reading kept at the window's end: back into time order (nearly sorted: cheap)
                self._points.sort(key=lambda q: q.t)
            self._best = [None] * len(self.fields)
            if len(self._points) > self.max_points:
                self._coarsen()

    def _due(self, p: _Point) -> bool:
        if self._last_t is None:
            return True
        gap = p.t - self._last_t
        if gap >= MAX_GAP_S * 2**self.level:
            return True
        return gap >= self._min_gap() and self._moved(p.vals)

    def _min_gap(self) -> float:
        return 0.0 if self.level == 0 else self.period_s * 2**self.level

    def _moved(self, vals: tuple) -> bool:
        for v, ref in zip(vals, self._ref):
            if v is not None and (ref is None or abs(v - ref) > max(MOVE_ABS, MOVE_REL * ref)):
                return True
        return False

    def _keep(self, p: _Point) -> None:
        p.kept = True
        self._points.append(p)
        self._pending.append(p)
        if self._last_t is None or p.t >= self._last_t:
            self._last_t = p.t
            self._ref = [v if v is not None else r for v, r in zip(p.vals, self._ref)]

    def _coarsen(self) -> None:
        """Every other unpinned point goes; later points twice as far apart. Pinned points go only when they alone
        overflow the cap (thousands of windows): then every other one, and the file says peaks_kept=false."""
        self.level += 1
        kept, drop = [], False
        for p in self._points:
            if p.pinned or not drop:
                kept.append(p)
            else:
                p.kept = False
            drop = drop if p.pinned else not drop
        if len(kept) > self.max_points:
            for p in kept[1::2]:
                p.kept = False
            kept, self.peaks_kept = kept[0::2], False
        self._points = kept
        self._rewrite = True

    # --- the file ---

    def set_fields(self, fields: Sequence[str]) -> None:
        """More fields (a GPU rank once its device is known): earlier points get null for them."""
        with self._lock:
            self._drain()  # readings taken so far have the fields of their time
            extra = len(fields) - len(self.fields)
            if tuple(fields[: len(self.fields)]) != self.fields or extra < 0:
                raise ValueError(f"series fields can only grow: {self.fields} -> {tuple(fields)}")
            waiting = {id(p): p for p in (*self._best, self._latest) if p is not None and not p.kept}
            for p in [*self._points, *waiting.values()]:
                p.vals = p.vals + (None,) * extra
            self.fields = tuple(fields)
            self._best += [None] * extra
            self._ref += [None] * extra
            self._rewrite = True

    def flush(self) -> None:
        """Append the points kept since the last flush (or rewrite the whole file after a coarsening)."""
        with self._lock:
            self._drain()
            if self._rewrite:
                head = header_line(self.rank, self.fields, self.clock_t0, self.level, self.peaks_kept)
                write_text_atomic(self.path, head + "".join(row_line(p.t, p.vals) for p in self._points))
                self._rewrite = False
            elif self._pending:
                with open(self.path, "a") as f:
                    f.write("".join(row_line(p.t, p.vals) for p in self._pending if p.kept))
            self._pending = []

    def stats(self) -> Dict[str, object]:
        return {"points": len(self.points), "level": self.level, "peaks_kept": self.peaks_kept}
