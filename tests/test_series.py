"""The memory-over-time series: thinned where nothing changes, every window's peak kept, bounded, readable after a
hard death, and on a real recorder the same peaks as the phase records."""

from __future__ import annotations

import json
import random
import time

from dsexp.core.series import column, read_series, series_file
from dsexp.rank.probes.memory_series import MAX_GAP_S, MemorySeries
from dsexp.rank.probes.phases import PhaseRecorder
from dsexp.rank.probes.sampler import ALLOCATOR_EVERY, PeakSampler

from helpers.memory import resident

MIB = 2**20
FIELDS = ("host_rss", "host_anon", "node_used")


def series(tmp_path, max_points=2000, fields=FIELDS) -> MemorySeries:
    return MemorySeries(tmp_path / "rank0.series.jsonl", 0, 1000.0, 0.0, fields, 0.01, max_points=max_points)


def drive(s: MemorySeries, readings, window: int):
    """Feed readings [(t, vals)] and close a window every `window` readings; return the windows' (t0, t1, peaks)."""
    windows, start, peaks = [], 0.0, {}
    for i, (t, vals) in enumerate(readings, 1):
        s.add(t, vals)
        for k, v in vals.items():
            peaks[k] = max(peaks.get(k, v), v)
        if i % window == 0:
            s.close_window()
            windows.append((start, t, peaks))
            start, peaks = t, {}
    return windows


def in_window(points, t0, t1):
    return [p for p in points if t0 < p.t <= t1]


def test_every_windows_peak_survives_thinning_and_coarsening_under_the_cap(tmp_path):
    rng = random.Random(5)
    rss, readings = 500 * MIB, []
    for i in range(30_000):  # 5 minutes at 10 ms, memory moving at every reading (the worst case)
        rss = max(100 * MIB, rss + rng.randint(-8, 8) * MIB)
        readings.append((i * 0.01, {"host_rss": rss, "host_anon": rss // 2, "node_used": 8000 * MIB + rss}))
    s = series(tmp_path, max_points=400)
    windows = drive(s, readings, window=1000)
    assert len(s.points) <= 400 and s.level >= 3 and s.peaks_kept
    assert [p.t for p in s.points] == sorted(p.t for p in s.points)
    for t0, t1, peaks in windows:
        pts = in_window(s.points, t0, t1)
        for i, f in enumerate(FIELDS):
            assert max(p.vals[i] for p in pts) == peaks[f], (t0, f)
        assert pts[-1].t == t1  # the closing reading is kept: the curve reaches the phase's end


def test_flat_memory_costs_a_point_per_max_gap(tmp_path):
    s = series(tmp_path)
    drive(
        s,
        [(i * 0.01, {"host_rss": 600 * MIB, "host_anon": 400 * MIB, "node_used": 9000 * MIB}) for i in range(6000)],
        6000,
    )
    # 60 s unchanged: one point per MAX_GAP_S, plus the window's closing reading
    assert abs(len(s.points) - 60 / MAX_GAP_S) <= 2


def test_small_moves_are_no_change_but_a_step_is(tmp_path):
    s = series(tmp_path)
    base = {"host_rss": 600 * MIB, "host_anon": 400 * MIB, "node_used": 9000 * MIB}
    s.add(0.0, base)
    s.add(0.01, {**base, "host_rss": 600 * MIB + 100_000})  # 0.1 MB: noise
    s.add(0.02, {**base, "host_anon": 430 * MIB})  # a 30 MiB step
    assert [p.t for p in s.points] == [0.0, 0.02]


def test_file_matches_memory_across_appends_and_rewrites_and_survives_a_torn_line(tmp_path):
    s = series(tmp_path, max_points=100)
    rng = random.Random(1)
    for chunk in range(10):
        drive(s, [(chunk + i * 0.01, {f: rng.randint(1, 1000) * MIB for f in FIELDS}) for i in range(50)], 25)
        s.flush()  # a heartbeat: appends, or rewrites after a coarsening
    with open(s.path, "a") as f:
        f.write("[9999.0,1,2")  # a rank killed while appending
    back = read_series(s.path)
    assert back["fields"] == list(FIELDS) and back["level"] == s.level > 0
    assert back["points"] == [[round(p.t, 6), *p.vals] for p in s.points]


def test_fields_grow_once_a_gpu_is_attached(tmp_path):
    s = series(tmp_path)
    s.add(0.0, {"host_rss": 1 * MIB, "host_anon": 1 * MIB, "node_used": 1 * MIB})
    s.set_fields(FIELDS + ("nvml_device_used",))
    s.add(0.5, {"host_rss": 1 * MIB, "host_anon": 1 * MIB, "node_used": 1 * MIB, "nvml_device_used": 7 * MIB})
    s.flush()
    back = read_series(s.path)
    assert back["fields"][-1] == "nvml_device_used"
    assert back["points"] == [[0.0, MIB, MIB, MIB, None], [0.5, MIB, MIB, MIB, 7 * MIB]]
    assert column(back, "nvml_device_used") == [(0.5, 7 * MIB)]


def test_recorder_series_holds_each_phases_sampled_peak_within_its_times(tmp_path):
    rec = PhaseRecorder(tmp_path, 0, 1, 0, time.perf_counter(), sample_ms=5, see_memory_usage=False)
    with rec.phase("load"):
        blobs = [resident(40 * MIB) for _ in range(4)]  # up, then down again within the phase
        time.sleep(0.1)
        del blobs
        time.sleep(0.05)
    with rec.phase("generate"):
        time.sleep(0.3)
    with rec.phase("generate"):  # a phase that happens twice is kept twice
        time.sleep(0.05)
        blob = resident(60 * MIB)  # its peak is its last moment: the reading that closes it must lie within it
    rec.finish()
    del blob
    s = read_series(series_file(tmp_path, 0))
    assert rec.record["series"]["file"] == "ranks/rank0.series.jsonl"
    assert rec.record["series"]["points"] == len(s["points"]) and s["peaks_kept"]
    assert [e["phase"] for e in rec.record["timeline"]] == ["load", "generate", "generate_2"]
    for e in rec.record["timeline"]:
        peaks = rec.record["phases"][e["phase"]]["peaks"]
        t0, t1 = round(e["t0"], 6), round(e["t1"], 6)  # the file's resolution
        inside = [p for p in s["points"] if t0 < p[0] <= t1]
        assert inside[-1][0] == t1  # the reading that closed the phase is its end
        for i, f in enumerate(s["fields"], 1):
            assert max(p[i] for p in inside if p[i] is not None) == peaks[f"{f}_peak"], (e["phase"], f)
    load = rec.record["phases"]["load"]
    assert load["peaks"]["host_anon_peak"] - load["host"]["host_anon"] > 120 * MIB  # the series saw what was freed
    head = json.loads(series_file(tmp_path, 0).read_text().splitlines()[0])
    assert head["clock_t0"] == rec.record["clock"]["t0"]


def test_a_rank_dying_mid_phase_leaves_its_curve_up_to_its_last_heartbeat(tmp_path):
    rec = PhaseRecorder(tmp_path, 0, 1, 0, time.perf_counter(), sample_ms=5, see_memory_usage=False)
    try:
        rec.begin("load")
        blob = resident(80 * MIB)
        time.sleep(1.3)  # heartbeats every 0.5 s; the phase never ends
        left = read_series(series_file(tmp_path, 0))  # what a SIGKILL now would leave
        now = time.perf_counter() - rec.t_process
    finally:
        rec.sampler.stop()
    del blob
    anon = [p[2] for p in left["points"]]
    assert max(anon) - anon[0] > 75 * MIB  # the allocation made inside the unfinished phase is in the file
    assert now - left["points"][-1][0] < MAX_GAP_S + 0.6  # flat since: a point a second, flushed every 0.5 s


def test_allocator_figures_go_to_the_series_only_sparingly_and_a_failing_read_costs_nothing(tmp_path):
    s = series(tmp_path, fields=FIELDS + ("gpu_alloc",))
    sampler = PeakSampler(series=s)
    reads = []
    sampler.allocator = lambda: reads.append(1) or {"gpu_alloc": 5 * MIB}
    for _ in range(2 * ALLOCATOR_EVERY):
        sampler.sample()
    assert len(reads) == 2  # one reading in ALLOCATOR_EVERY
    peaks = sampler.take()
    assert len(reads) == 3  # and the one that closes a window
    assert "gpu_alloc_peak" not in peaks and peaks["host_rss_peak"] > 0  # torch's own peaks stay the record's
    assert s.points[-1].vals[-1] == 5 * MIB

    def broken():
        raise RuntimeError("allocator stats unavailable")

    sampler.allocator = broken
    assert sampler.take()["host_rss_peak"] > 0  # a phase end never fails on the series' extras
    assert s.points[-1].vals[-1] is None
    sampler.stop()
