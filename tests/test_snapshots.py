"""PyTorch memory snapshots: the size cap, the summary tool on the documented snapshot format, and (GPU) a real job
that dumps one snapshot per rank and phase and lists each in its rank record."""

from __future__ import annotations

import gzip
import io
import json
import pickle
import time
from pathlib import Path

import pytest

from dsexp.analysis.snapshot_summary import load, main, site, summarise
from dsexp.rank.probes.phases import PhaseRecorder
from dsexp.rank.probes.snapshots import TooBig, _CappedFile

from helpers.run import run_dsexp, sweep_results

MODEL = "/x/transformers/models/llama/modeling_llama.py"
TORCH = "/x/torch/nn/modules/linear.py"


def frames(*where):
    return [{"filename": f, "line": line, "name": name} for f, line, name in where]


def snapshot() -> dict:
    """Two segments and a history, in the format torch.cuda.memory._snapshot() documents."""
    qkv = frames((TORCH, 125, "forward"), (MODEL, 300, "attention"))
    mlp = frames((MODEL, 180, "mlp"))
    return {
        "segments": [
            {
                "address": 0,
                "total_size": 20 << 20,
                "stream": 0,
                "segment_type": "large",
                "allocated_size": 12 << 20,
                "active_size": 12 << 20,
                "blocks": [
                    {
                        "size": 8 << 20,
                        "requested_size": 8 << 20,
                        "address": 0,
                        "state": "active_allocated",
                        "frames": qkv,
                    },
                    {
                        "size": 4 << 20,
                        "requested_size": 4 << 20,
                        "address": 8 << 20,
                        "state": "active_allocated",
                        "frames": mlp,
                    },
                    {"size": 8 << 20, "requested_size": 0, "address": 12 << 20, "state": "inactive", "frames": []},
                ],
            },
            {
                "address": 1 << 30,
                "total_size": 2 << 20,
                "stream": 0,
                "segment_type": "small",
                "allocated_size": 0,
                "active_size": 0,
                "blocks": [],
            },
        ],
        "device_traces": [
            [
                {"action": "alloc", "addr": 0, "size": 8 << 20, "stream": 0, "frames": qkv},
                {"action": "alloc", "addr": 12 << 20, "size": 6 << 20, "stream": 0, "frames": mlp},  # a temporary
                {"action": "free_requested", "addr": 12 << 20, "size": 6 << 20, "stream": 0, "frames": mlp},
                {"action": "free_completed", "addr": 12 << 20, "size": 6 << 20, "stream": 0, "frames": mlp},
                {"action": "alloc", "addr": 8 << 20, "size": 4 << 20, "stream": 0, "frames": mlp},
            ]
        ],
    }


def test_summary_names_sites_outside_torch_and_the_historys_peak(tmp_path):
    path = tmp_path / "rank1_generate_2.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    out = tmp_path / "summary.json"
    assert main([str(tmp_path), "--top", "5", "--out", str(out)]) == 0
    (s,) = json.loads(out.read_text())["snapshots"]
    assert (s["rank"], s["phase"], s["file"]) == (1, "generate_2", path.name)
    assert (s["reserved_bytes"], s["allocated_bytes"], s["segments"]) == (22 << 20, 12 << 20, 2)
    assert s["live_by_site"] == [
        {"site": f"{MODEL}:300 attention", "bytes": 8 << 20},  # the caller of torch's Linear, not Linear
        {"site": f"{MODEL}:180 mlp", "bytes": 4 << 20},
    ]
    h = s["history"]
    assert h["actions"] == {"alloc": 3, "free_requested": 1, "free_completed": 1} and h["oom"] == 0
    assert h["allocated_by_site"][0] == {"site": f"{MODEL}:180 mlp", "bytes": 10 << 20}
    # 8 + 6 MiB live at once before the temporary was freed: the phase went 2 MiB above where it ended
    assert h["allocated_peak_bytes"] == 14 << 20


def test_the_events_written_are_the_historys_in_order_and_replay_to_its_peak(tmp_path):
    """--events: each file's allocator events as [action, bytes, address], what the allocator model replays (the
    replay of a load and a generate held to the GPU's own events)."""
    from dsexp.predict.allocator import Allocator

    (tmp_path / "rank0_load.pickle").write_bytes(pickle.dumps(snapshot()))
    (tmp_path / "rank1_load.pickle").write_bytes(pickle.dumps({**snapshot(), "device_traces": [[]]}))
    events_file = tmp_path / "events.json.gz"
    assert main([str(tmp_path), "--out", str(tmp_path / "s.json"), "--events", str(events_file)]) == 0
    first, second = json.loads(gzip.open(events_file, "rt").read())["snapshots"]
    assert (first["rank"], first["phase"], second["rank"], second["events"]) == (0, "load", 1, [])
    assert main([str(tmp_path), "--rank", "1", "--out", str(tmp_path / "s.json"), "--events", str(events_file)]) == 0
    assert [s["rank"] for s in json.loads(gzip.open(events_file, "rt").read())["snapshots"]] == [1]
    assert first["events"] == [
        ["alloc", 8 << 20, 0],
        ["alloc", 6 << 20, 12 << 20],
        ["free_requested", 6 << 20, 12 << 20],
        ["free_completed", 6 << 20, 12 << 20],
        ["alloc", 4 << 20, 8 << 20],
    ]
    replay = [
        ("alloc", a, n) if act == "alloc" else ("free", a, 0)
        for act, n, a in first["events"]
        if act != "free_completed"
    ]
    assert Allocator().run(replay).peak_allocated == 14 << 20  # as the summary's history peak


def test_a_pickle_naming_a_class_is_refused(tmp_path):
    path = tmp_path / "rank0_load.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "x": Path("/etc")}))
    with pytest.raises(pickle.UnpicklingError, match="names pathlib"):
        load(path)
    assert main([str(path)]) == 1


def test_site_falls_back_to_the_innermost_frame():
    assert site(frames((TORCH, 1, "f"))) == f"{TORCH}:1 f"
    assert site([]) == "(no stack)"


def test_capped_file_writes_a_whole_pickle_under_the_cap_and_stops_over_it():
    snap = summarise(snapshot()) | {"pad": "x" * 50_000}
    data = pickle.dumps(snap, protocol=pickle.HIGHEST_PROTOCOL)
    buf = io.BytesIO()
    pickle.dump(snap, _CappedFile(buf, len(data)), protocol=pickle.HIGHEST_PROTOCOL)
    assert buf.getvalue() == data
    small = io.BytesIO()
    with pytest.raises(TooBig):
        pickle.dump(snap, _CappedFile(small, 10_000), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(small.getvalue()) <= 10_000


@pytest.mark.gpu
def test_gpu_job_dumps_a_snapshot_per_rank_and_phase(tmp_path, cache_dir):
    run_dsexp(
        [
            "-m",
            "tp=1",
            "device=cuda",
            "probe.memory_snapshot=true",
            "probe.snapshot_max_mb=256,0.001",
            "hydra.sweep.dir=multirun/snap",
        ],
        tmp_path,
        cache_dir,
    )
    kept, capped = sweep_results(tmp_path / "multirun" / "snap")
    for res in (kept, capped):
        assert res["status"] == "ok", res.get("failure")
    job = Path(kept["job_dir"])
    for e in kept["ranks"][0]["timeline"]:
        listed = kept["ranks"][0]["phases"][e["phase"]]["memory_snapshot"]
        assert listed["file"] == f"ranks/snapshots/rank0_{e['phase']}.pickle"
        assert (job / listed["file"]).stat().st_size == listed["bytes"] <= 256 * 2**20
        summary = summarise(load(job / listed["file"]))
        if e["phase"] == "load":  # the eager load keeps the weights on the host: nothing on the GPU yet
            assert summary["segments"] == 0
        elif e["phase"] != "start":
            assert summary["segments"] > 0
    phases = capped["ranks"][0]["phases"]
    for name in ("init", "generate"):  # each allocates far more than 1 KiB of history
        listed = phases[name]["memory_snapshot"]
        assert "skipped" in listed and "file" not in listed
        assert not (Path(capped["job_dir"]) / f"ranks/snapshots/rank0_{name}.pickle").exists()
    assert not list(Path(capped["job_dir"]).glob("ranks/snapshots/*.tmp"))


def test_a_torch_that_cannot_record_is_noted_not_fatal(tmp_path):
    """This CPU build of torch has no CUDA allocator to record: the rank notes it and goes on without snapshots."""
    rec = PhaseRecorder(tmp_path, 0, 1, 0, time.perf_counter(), sample_ms=0, see_memory_usage=False)
    rec._start_snapshots({"max_entries": 10, "max_bytes": 2**20})
    with rec.phase("load"):
        pass
    rec.finish()
    assert rec.snapshots is None and "memory_snapshot" not in rec.record["phases"]["load"]
    assert "_cuda_record_memory_history" in rec.record["memory_snapshot_error"]
