"""Where a peak-sampler reading's time goes on a GPU machine, in a process that holds a CUDA context and some device
memory, as a rank does: each probe timed warm (back to back) and cold (once after each 10 ms sleep, as the sampler's
thread runs it), then the sampler's thread itself for 5 s at its default and at other settings. Needs a CUDA GPU:
    python benchmarks/sampler_cost.py > sampler_cost.json   (campaign sampler_cost; make benchmark NAME=sampler_cost)"""

from __future__ import annotations

import json
import sys
import threading
import time

import torch

from dsexp.core.schema import ProbeConfig
from dsexp.rank.probes import sampler as sampler_mod
from dsexp.rank.probes.gpu import NvmlDevice, allocator_reading
from dsexp.rank.probes.host import ProcFiles
from dsexp.rank.probes.sampler import PeakSampler

DEFAULT_MS = ProbeConfig.sample_ms


def per_call_us(fn, n: int = 2000) -> float:
    fn()
    c0 = time.thread_time()
    for _ in range(n):
        fn()
    return round(1e6 * (time.thread_time() - c0) / n, 1)


def cold_us(fn, n: int = 300, gap_s: float = 0.01) -> float:
    """CPU per call when each call follows a sleep of gap_s in its own thread (the sampler's situation)."""
    out = []

    def run():
        wait, total = threading.Event(), 0.0
        for _ in range(n):
            wait.wait(gap_s)
            c0 = time.thread_time()
            fn()
            total += time.thread_time() - c0
        out.append(total)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return round(1e6 * out[0] / n, 1)


def thread_cost(seconds: float = 5.0, period_s: float = 0.01, cls=PeakSampler, **kw) -> dict:
    s = cls(period_s, **kw).start()
    time.sleep(seconds)
    s.stop()
    return {
        "period_ms": period_s * 1000,
        "samples": s.samples,
        "cpu_us_per_reading": round(1e6 * s.cpu_s / s.samples, 1),
        "core_pct": round(100 * s.cpu_s / seconds, 3),
    }


class EveryReadingFull(PeakSampler):
    """The sampler before its readings were split: status, meminfo and NVML's device figure at every reading."""

    def _read(self, at_end):
        vals = {**self._proc.read(), "nvml_device_used": self.nvml.used()}
        if at_end or self.samples % 5 == 0:
            vals["nvml_process_used"] = self.nvml.process_used()
        return {k: v for k, v in vals.items() if v is not None}, {}


class NvmlEveryReading(PeakSampler):
    """NVML's device figure at every reading as well (the first candidate, 1.3% of a core on the H200)."""

    def _read(self, at_end):
        vals, extra = super()._read(at_end)
        used = self.nvml.used()
        return ({**vals, "nvml_device_used": used} if used is not None else vals), extra


def main() -> int:
    x = torch.empty(2**28, dtype=torch.uint8, device="cuda:0")  # a context and 256 MiB on the device
    nvml, proc = NvmlDevice(0), ProcFiles()
    probes = {
        "statm (RSS, anon)": proc.read_rss,
        "status + meminfo (split, node)": proc.read,
        "nvml device used": nvml.used,
        "nvml process list": nvml.process_used,
        "torch allocator stats": lambda: allocator_reading(0),
        "sampler reading (default mix)": PeakSampler(0.01, nvml=nvml).sample,
    }
    out = {
        "device": torch.cuda.get_device_name(0),
        "full_every": sampler_mod.FULL_EVERY,
        "probes_us": {name: {"warm": per_call_us(fn, 500), "cold": cold_us(fn)} for name, fn in probes.items()},
        "threads": {
            f"default, {DEFAULT_MS:g} ms": thread_cost(period_s=DEFAULT_MS / 1000, nvml=nvml),
            "default readings, 10 ms": thread_cost(nvml=nvml),
            "NVML device figure at every reading, 10 ms": thread_cost(cls=NvmlEveryReading, nvml=nvml),
            "before (full every reading), 10 ms": thread_cost(cls=EveryReadingFull, nvml=nvml),
            f"default, {DEFAULT_MS:g} ms, main thread busy in Python": busy(
                lambda: thread_cost(period_s=DEFAULT_MS / 1000, nvml=nvml)
            ),
        },
    }
    del x
    json.dump(out, sys.stdout, indent=1)
    return 0


def busy(measure):
    """Run `measure` while this process's main thread computes in Python (a rank loading a model)."""
    result = []
    t = threading.Thread(target=lambda: result.append(measure()))
    t.start()
    n = 0
    while t.is_alive():
        n += sum(i * i for i in range(1000))
    t.join()
    return result[0]


if __name__ == "__main__":
    sys.exit(main())
