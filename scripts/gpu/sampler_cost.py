"""Where a peak-sampler reading's time goes on a GPU machine: each probe timed alone in a process that holds
a CUDA context and some device memory, as a rank does. Usage (device machine, env sourced):
    python3 scripts/gpu/sampler_cost.py > $OUT/sampler_cost.json"""

from __future__ import annotations

import json
import sys
import time

import torch

from dsexp.rank.probes.gpu import NvmlDevice
from dsexp.rank.probes.host import ProcFiles
from dsexp.rank.probes.sampler import PeakSampler


def per_call_us(fn, n: int = 2000) -> dict:
    fn()
    c0, t0 = time.thread_time(), time.perf_counter()
    for _ in range(n):
        fn()
    return {"cpu_us": 1e6 * (time.thread_time() - c0) / n, "wall_us": 1e6 * (time.perf_counter() - t0) / n}


def main() -> int:
    x = torch.empty(2**28, dtype=torch.uint8, device="cuda:0")  # a context and 256 MiB on the device
    nvml, proc = NvmlDevice(0), ProcFiles()
    sampler = PeakSampler(0.01, nvml=nvml)
    out = {
        "device": torch.cuda.get_device_name(0),
        "host_proc_read": per_call_us(proc.read),
        "nvml_device_used": per_call_us(nvml.used),
        "nvml_process_list": per_call_us(nvml.process_used, 500),
        "sampler_reading_mixed": per_call_us(sampler.sample),
    }
    for period in (0.01, 0.02):  # the thread as it runs in a rank: a reading, then a wait of `period`
        s = PeakSampler(period, nvml=nvml).start()
        time.sleep(5)
        s.stop()
        out[f"thread_{period * 1000:g}ms_5s"] = {
            "samples": s.samples,
            "cpu_s": s.cpu_s,
            "cpu_us_per_reading": 1e6 * s.cpu_s / s.samples,
            "core_pct": 100 * s.cpu_s / 5.0,
        }
    del x
    json.dump(out, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
