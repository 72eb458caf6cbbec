"""PyTorch memory snapshots of a GPU rank, one per phase (`probe.memory_snapshot=true`).

Recording starts when the rank takes its device (`torch.cuda.memory._record_memory_history`, at most `max_entries`
allocator events kept, Python stacks only: C++ stacks make every dump slow to symbolise). At the end of every phase
the allocator's state and the events since the previous dump go to `ranks/snapshots/rank{N}_{phase}.pickle` (the
history is then cleared, so each file holds its own phase's events; pytorch.org/memory_viz opens it). A dump that
would pass `max_bytes` is abandoned as it is written and recorded as skipped, so a phase never leaves a file over
the cap.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from pathlib import Path
from typing import Any, Dict, Optional

RECORD = {"enabled": "all", "context": "all", "stacks": "python"}


class TooBig(Exception):
    pass


class _CappedFile:
    """A file that refuses to grow past `cap` bytes (pickle.dump writes through it)."""

    def __init__(self, f, cap: int):
        self.f, self.cap, self.written = f, cap, 0

    def write(self, data) -> int:
        self.written += len(data)
        if self.written > self.cap:
            raise TooBig(self.written)
        return self.f.write(data)


class MemorySnapshots:
    def __init__(self, job_dir: Path, rank: int, max_entries: int, max_bytes: int):
        self.job_dir, self.rank = Path(job_dir), rank
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self.started = False

    def start(self) -> None:
        import torch

        torch.cuda.memory._record_memory_history(**RECORD, max_entries=self.max_entries)
        self.started = True

    def relative(self, phase: str) -> str:
        return f"ranks/snapshots/rank{self.rank}_{phase}.pickle"

    def dump(self, phase: str) -> Dict[str, Any]:
        """Write this phase's snapshot; return what the rank record lists (file, bytes, events, seconds), or why
        there is no file."""
        import torch

        t = time.perf_counter()
        snap = torch.cuda.memory._snapshot()
        events = sum(len(trace) for trace in snap.get("device_traces", ()))
        path = self.job_dir / self.relative(phase)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        out: Dict[str, Any] = {"events": events, "max_entries": self.max_entries}
        try:
            with open(tmp, "wb") as f:
                pickle.dump(snap, _CappedFile(f, self.max_bytes), protocol=pickle.HIGHEST_PROTOCOL)
            os.replace(tmp, path)
            out.update(file=self.relative(phase), bytes=path.stat().st_size)
        except TooBig:
            out.update(skipped=f"over probe.snapshot_max_mb ({self.max_bytes / 2**20:g} MiB)", cap_bytes=self.max_bytes)
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        del snap
        self._clear()
        out["dump_s"] = time.perf_counter() - t
        return out

    def _clear(self) -> None:
        """Start the next phase's history afresh (older torch has no clear_history: the history then accumulates,
        up to max_entries)."""
        import torch

        with contextlib.suppress(TypeError):
            torch.cuda.memory._record_memory_history(**RECORD, max_entries=self.max_entries, clear_history=True)

    def stop(self) -> None:
        if self.started:
            import torch

            with contextlib.suppress(Exception):
                torch.cuda.memory._record_memory_history(enabled=None)


def snapshot_options(probe) -> Optional[dict]:
    """probe.memory_snapshot's limits as the recorder takes them; None when off."""
    if not probe.memory_snapshot:
        return None
    return {"max_entries": int(probe.snapshot_max_entries), "max_bytes": int(probe.snapshot_max_mb * 2**20)}
