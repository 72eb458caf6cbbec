"""Probes: the sampler sees peaks between snapshots, RSS splits anon/file, DeepSpeed's printout parses."""

from __future__ import annotations

import json
import mmap
import subprocess
import sys
import textwrap
import time

import torch

from dsexp.core.records import aggregate_metrics, headline
from dsexp.rank.probes.host import ProcFiles, host_snapshot, node_used, status_rss
from dsexp.rank.probes.phases import PhaseRecorder
from dsexp.rank.probes.sampler import PeakSampler
from dsexp.rank.probes.see_memory import parse
from dsexp.rank.probes.weights import resident_bytes, weight_census

from helpers.memory import resident


def test_sampler_catches_a_transient_peak():
    s = PeakSampler(0.005).start()
    try:
        s.take()
        before = status_rss()["host_anon"]
        blob = resident(300 * 2**20)  # touched: anonymous resident memory
        time.sleep(0.1)
        del blob
        time.sleep(0.05)
        after = status_rss()["host_anon"]
        peaks = s.take()
    finally:
        s.stop()
    assert after - before < 50 * 2**20  # freed again, so only the sampler can have seen it
    assert peaks["host_anon_peak"] - before > 250 * 2**20
    assert s.samples > 5 and s.cpu_s < 0.5


def test_held_open_proc_files_follow_memory_as_fresh_reads_do():
    files = ProcFiles()
    try:
        before = files.read()
        blob = resident(200 * 2**20)
        during, fresh = files.read(), status_rss()
        del blob
    finally:
        files.close()
    assert set(before) == {"host_rss", "host_anon", "host_file", "host_shmem", "node_used"}
    assert during["host_anon"] - before["host_anon"] > 190 * 2**20
    assert abs(during["host_anon"] - fresh["host_anon"]) < 8 * 2**20
    assert abs(during["node_used"] - node_used()) < 256 * 2**20


def test_recorder_without_sampler_thread_keeps_phase_end_peaks(tmp_path):
    rec = PhaseRecorder(tmp_path, 0, 1, 0, time.perf_counter(), sample_ms=0, see_memory_usage=False)
    with rec.phase("load"):
        blob = resident(100 * 2**20)
    rec.finish()
    del blob
    phase = rec.record["phases"]["load"]
    # the phase's own two readings, and the one that ends the memory series when the rank finishes
    assert rec.record["sampler"] == {"samples": 3, "cpu_s": 0.0, "period_s": 0.0}
    assert abs(phase["peaks"]["host_anon_peak"] - phase["host"]["host_anon"]) < 4 * 2**20
    assert rec.record["clock"]["created"] <= rec.record["clock"]["t0"] <= time.time()


def test_file_backed_pages_are_not_anonymous(tmp_path):
    f = tmp_path / "blob"
    f.write_bytes(b"\1" * (64 * 2**20))
    before = status_rss()
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as m:
        sum(m[i] for i in range(0, len(m), 4096))  # fault every page in
        during = status_rss()
    assert during["host_file"] - before["host_file"] > 60 * 2**20
    assert during["host_anon"] - before["host_anon"] < 16 * 2**20


def test_host_snapshot_has_uss_pss_and_node():
    snap = host_snapshot()
    assert 0 < snap["host_uss"] <= snap["host_rss"] and 0 < snap["host_pss"] <= snap["host_rss"]
    assert 0 < snap["node_used"] < snap["node_total"]


def test_see_memory_usage_printout_parses():
    text = (
        "After load model\nMA 37.74 GB         Max_MA 37.74 GB         CA 37.75 GB         Max_CA 38 GB \n"
        "CPU Virtual Memory:  used = 92.87 GB, percent = 18.4%"
    )
    got = parse(text)
    assert got["printed"] and got["MA_GB"] == 37.74 and got["Max_CA_GB"] == 38 and got["cpu_used_GB"] == 92.87
    assert not parse("")["printed"]


def test_weight_census_counts_params_buffers_and_meta():
    m = torch.nn.Sequential(torch.nn.Linear(4, 8, dtype=torch.bfloat16), torch.nn.LayerNorm(8))
    m.register_buffer("cache", torch.zeros(10))
    with torch.device("meta"):
        m.append(torch.nn.Linear(8, 2))
    c = weight_census(m)
    assert c["param_bytes"]["cpu"] == (4 * 8 + 8) * 2 + 16 * 4
    assert c["param_bytes"]["meta"] == (8 * 2 + 2) * 4
    assert c["on_meta"] == ["2.weight", "2.bias"]
    assert resident_bytes(c, "cpu") == c["param_bytes"]["cpu"] + 40


def test_sampler_reads_nvml_sparingly_but_at_every_window_end():
    from dsexp.rank.probes.sampler import FULL_EVERY

    class FakeNvml:
        device_reads = process_reads = 0

        def used(self):
            self.device_reads += 1
            return 7

        def process_used(self):
            self.process_reads += 1
            return 3

    nvml = FakeNvml()
    s = PeakSampler(nvml=nvml)
    for _ in range(2 * FULL_EVERY):
        s.sample()
    assert (nvml.device_reads, nvml.process_reads) == (2, 2) and "node_used" in s.last and s.samples == 2 * FULL_EVERY
    peaks = s.take()
    assert (peaks["nvml_process_used_peak"], peaks["nvml_device_used_peak"]) == (3, 7)
    assert (nvml.device_reads, nvml.process_reads) == (3, 3)
    s.stop()


def test_host_peak_is_the_kernels_high_water_mark_whatever_the_sampler_saw(tmp_path):
    """A spike between two readings (here no sampler thread at all: the phase's own readings) is in the headline:
    the host peak is the RSS high-water mark (VmHWM) read at the phase's end. In a fresh process: the test runner's
    own high-water mark would hide the spike."""
    code = textwrap.dedent(
        f"""
        import json, time
        from dsexp.rank.probes.phases import PhaseRecorder
        from dsexp.rank.probes.host import status_rss
        rec = PhaseRecorder({str(tmp_path)!r}, 0, 1, 0, time.perf_counter(), sample_ms=0, see_memory_usage=False)
        with rec.phase("load"):
            before = status_rss()["host_rss"]
            blob = b"x" * (300 * 2**20)  # written, so resident
            del blob
        rec.finish()
        print(json.dumps({{"before": before, "record": rec.record}}))
        """
    )
    out = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)
    before, record = out["before"], out["record"]
    load = record["phases"]["load"]
    assert load["peaks"]["host_rss_peak"] - before < 100 * 2**20  # the phase's readings missed the spike
    assert load["host"]["host_rss_hwm"] - before > 290 * 2**20
    head = headline(aggregate_metrics([record]), [record], new_tokens=1)
    assert head["host_peak_gib"] * 2**30 == max(ph["host"]["host_rss_hwm"] for ph in record["phases"].values())


def test_a_split_window_inside_a_phase_keeps_the_phases_own_peak(tmp_path):
    """A point's prefill window is closed inside its phase (PhaseRecorder.split_window): the window has the peak it
    saw and the phase still has the whole phase's."""
    rec = PhaseRecorder(tmp_path, 0, 1, 0, time.perf_counter(), sample_ms=0, see_memory_usage=False)
    key = rec.begin("generate[b=1,l=8]")
    hog = resident(256 * 2**20)
    first = rec.split_window()["host_rss_peak"]
    del hog
    second = rec.split_window()["host_rss_peak"]
    rec.end(key)
    phase = rec.record["phases"]["generate[b=1,l=8]"]
    assert first - second > 200 * 2**20
    assert phase["peaks"]["host_rss_peak"] >= first
    assert rec.record["timeline"][-1]["kind"] == "generate"
    rec.finish()
