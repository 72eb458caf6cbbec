"""benchmarks/search_cost.py's measured part (issue 45): a one-load search set beside the committed search of the same
budget, from their budget.json and jobs' result.json as dsexp writes them. Built here as folders of the same shape
(a committed search with a job per guess, a one-load search bisecting in one job) so that the comparison is checked
before the H200 runs it."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30
KEY = "tp=2 load=meta trim=all"


@pytest.fixture
def search_cost(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    spec = importlib.util.spec_from_file_location("search_cost", ROOT / "benchmarks" / "search_cost.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(module, "BUDGET", tmp_path)
    return module


def job(folder: Path, name: str, points, reserved_gib, wall_s: float, plain_phase: bool = False) -> str:
    """A job's result.json: its points in the order run and each point's phase's reserved peak, on two ranks (rank 1
    1 MiB above rank 0); a job of one point may name its phase plain `generate`."""

    def rank(extra: int) -> dict:
        phases = {
            "generate" if plain_phase else f"generate[b={b},l=2048]": {
                "gpu": {"gpu_reserved_peak": int(r * GIB) + extra}
            }
            for (b, _), r in zip(points, reserved_gib)
        }
        return {"points": [{"batch": b, "status": s} for b, s in points], "phases": phases}

    (folder / name).mkdir(parents=True)
    (folder / name / "result.json").write_text(json.dumps({"ranks": [rank(0), rank(2**20)], "wall_s": wall_s}))
    return f"/on/the/h200/{folder.name}/{name}"


def search(folder: Path, jobs, ok, oom, key: str = KEY, overrides=("tp=2", "load=meta", "trim=all")) -> None:
    """A budget.json of one configuration: its key names the dimensions its search varied, its overrides all of it."""
    points = [{"batch": b, "status": s, "job": path} for path, pts in jobs for b, s in pts]
    folder.mkdir(parents=True, exist_ok=True)
    config = {"key": key, "overrides": list(overrides), "points": points, "largest_ok": ok, "smallest_oom": oom}
    (folder / "budget.json").write_text(json.dumps({"configs": [config]}))


def test_a_one_load_search_is_set_beside_the_committed_one_of_its_budget(search_cost, tmp_path):
    committed = tmp_path / "gpu40"
    search(
        committed,
        [
            (job(committed, "0", [(12, "oom")], [37.9], 60.0, plain_phase=True), [(12, "oom")]),
            (job(committed, "1", [(10, "ok"), (11, "oom")], [38.0, 38.4], 90.0), [(10, "ok"), (11, "oom")]),
            (job(committed, "2", [(11, "oom")], [38.5], 61.0, plain_phase=True), [(11, "oom")]),
        ],
        10,
        11,
    )
    one = tmp_path / "gpu40_one_load"
    ran = [(12, "oom"), (11, "oom"), (10, "ok")]  # the guess, then one below and one more: one load
    search(one, [(job(one, "0", ran, [37.9, 38.6, 38.0], 120.0), ran)], 10, 11)

    (row,) = search_cost.measured_rows("gpu40_one_load", ("gpu40",))
    assert (row["bracket"], row["same_answer"], row["loads"], row["points"], row["wall_s"]) == (
        [10, 11],
        True,
        1,
        3,
        120.0,
    )
    assert row["committed"] == {
        "search": "gpu40",
        "config": KEY,
        "bracket": [10, 11],
        "loads": 3,
        "points": 4,
        "wall_s": 211.0,
    }
    # 11 and 10 ran after an out-of-memory point of the same job; the fresh process that ran 11 first is job 2 (job
    # 1 ran 11 after 10, its cache kept: not fresh), and 10 was run first by job 1. Peaks: the highest rank (rank 1)
    peak = lambda gib: int(gib * GIB) + 2**20  # noqa: E731
    common = {"cache_emptied": True, "status_fresh": None, "fresh_from": "gpu40"}
    assert row["in_load"] == [
        {**common, "batch": 11, "after": "12 oom", "status": "oom", "reserved_in_process": peak(38.6),
         "status_fresh": "oom", "reserved_fresh": peak(38.5)},
        {**common, "batch": 10, "after": "11 oom", "status": "ok", "reserved_in_process": peak(38.0),
         "status_fresh": "ok", "reserved_fresh": peak(38.0)},
    ]  # fmt: skip
    text = search_cost.render_measured([row])
    assert (
        "| gpu40_one_load: `tp=2 load=meta trim=all` | - | - | 10 / 11 | 1 / 3 / 120 | 10 / 11 | yes | 3 / 4 / 211 |"
        in (text)
    )
    assert (
        "| gpu40_one_load: `tp=2 load=meta trim=all` | 11 | 12 oom | yes | oom | oom | 38.60 | 38.50 | +102 |" in text
    )
    assert "| gpu40_one_load: `tp=2 load=meta trim=all` | 10 | 11 oom | yes | ok | ok | 38.00 | 38.00 | +0 |" in text
    assert "1 of the 1 configurations with a committed search found its answer; 1 of 1 settled in at most 3" in text


def test_a_different_answer_is_shown_with_both_brackets(search_cost, tmp_path):
    committed = tmp_path / "gpu40"
    search(
        committed,
        [(job(committed, "0", [(9, "ok"), (10, "oom")], [37.0, 38.0], 80.0), [(9, "ok"), (10, "oom")])],
        9,
        10,
    )
    one = tmp_path / "gpu40_one_load"
    search(one, [(job(one, "0", [(10, "ok"), (11, "oom")], [38.0, 38.9], 70.0), [(10, "ok"), (11, "oom")])], 10, 11)
    (row,) = search_cost.measured_rows("gpu40_one_load", ("gpu40",))
    assert row["same_answer"] is False
    # 11 ran after 10 in the one load, its cache kept (a record without `start`); fresh, job 0 ran 10 out of memory
    (later,) = row["in_load"]
    assert (later["batch"], later["after"], later["cache_emptied"], later["status_fresh"]) == (11, "10 ok", False, None)
    assert later["fresh_from"] is None
    text = search_cost.render_measured([row])
    assert "| 10 / 11 | 1 / 2 / 70 | 9 / 10 | no |" in text
    assert "0 of the 1 configurations with a committed search found its answer" in text


def test_a_point_after_another_is_held_to_the_same_searchs_own_fresh_load_first(search_cost, tmp_path):
    # committed: 6 ran first in a job of its own; the one-load search ran 7 (oom) then 6, and confirmed 6 as a fresh
    # load's first point: that confirmation (the same code) is the reference, not the committed job
    committed = tmp_path / "gpu40"
    search(committed, [(job(committed, "0", [(6, "ok"), (7, "oom")], [17.0, 18.0], 80.0), [(6, "ok"), (7, "oom")])],
           6, 7)  # fmt: skip
    one = tmp_path / "gpu40_one_load"
    in_load, confirmed = [(7, "oom"), (6, "ok")], [(6, "ok")]
    search(one, [(job(one, "0", in_load, [18.3, 17.55], 120.0), in_load),
                 (job(one, "1", confirmed, [17.27], 70.0), confirmed)], 6, 7)  # fmt: skip
    (row,) = search_cost.measured_rows("gpu40_one_load", ("gpu40",))
    (after,) = row["in_load"]
    assert (after["batch"], after["after"], after["fresh_from"]) == (6, "7 oom", "gpu40_one_load")
    assert after["reserved_fresh"] == int(17.27 * GIB) + 2**20
    text = search_cost.render_measured([row])
    assert "| 6 | 7 oom | yes | ok | ok | 17.55 | 17.27 | +287 | gpu40_one_load |" in text


def test_before_the_h200_ran_it_the_report_says_it_was_not_measured(search_cost):
    assert search_cost.measured_rows("gpu40_one_load", ("gpu40",)) == []
    text = search_cost.render_measured([])
    assert "Not measured yet: no gpu40_one_load or gpu40_from_load or gpu24_one_load" in text
    assert "<!-- section: measured -->" in text


def test_a_one_load_search_with_no_committed_one_is_listed_alone(search_cost, tmp_path):
    one = tmp_path / "llama48_tp1"
    search(one, [(job(one, "0", [(14, "ok"), (15, "oom")], [47.0, 47.5], 50.0), [(14, "ok"), (15, "oom")])], 14, 15)
    (row,) = search_cost.measured_rows("llama48_tp1", ())
    assert (row["committed"], row["same_answer"], row["bracket"]) == (None, False, [14, 15])
    assert (
        "| llama48_tp1: `tp=2 load=meta trim=all` | - | - | 14 / 15 | 1 / 2 / 50 | - / - | (no committed search) | - |"
        in (search_cost.render_measured([row]))
    )


def test_a_configuration_is_matched_by_what_it_is_not_by_its_sweeps_key(search_cost, tmp_path):
    """The committed search varied tp (key `tp=2 trim=all`), the one-load one fixed it (key `trim=all`): the same
    configuration. Its expandable-segments twin is another one, and has no committed search to match."""
    committed = tmp_path / "gpu24"
    ran = [(2, "ok"), (3, "oom")]
    search(committed, [(job(committed, "0", ran, [23.0, 23.9], 80.0), ran)], 2, 3, key="tp=2 trim=all")
    one = tmp_path / "gpu24_one_load"
    search(one, [(job(one, "0", ran, [23.0, 23.9], 60.0), ran)], 2, 3, key="trim=all",
           overrides=("load=meta", "trim=all", "tp=2"))  # fmt: skip
    (row,) = search_cost.measured_rows("gpu24_one_load", ("gpu24",))
    assert (row["same_answer"], row["committed"]["config"]) == (True, "tp=2 trim=all")
    twin = tmp_path / "twin"
    expandable = ("load=meta", "trim=all", "tp=2", "++trim.env.PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    search(twin, [(job(twin, "0", ran, [23.0, 23.9], 60.0), ran)], 2, 3, key="trim=all", overrides=expandable)
    (row,) = search_cost.measured_rows("twin", ("gpu24",))
    assert row["committed"] is None


def test_the_fresh_reference_is_a_step_of_its_own_and_the_gpu_and_guess_are_the_runs(search_cost, tmp_path):
    one = tmp_path / "llama24_tp2"
    ran = [(8, "oom"), (7, "ok")]  # the guess ran out of memory, one below ran in the same load
    search(one, [(job(one, "0", ran, [23.3, 22.94], 55.0), ran)], 7, 8)
    result = json.loads((one / "0" / "result.json").read_text())
    (one / "0" / "result.json").write_text(json.dumps({**result, "config": {"generate": {"bisect_from": 8}}}))
    fresh = tmp_path / "llama24_tp2_fresh"
    search(fresh, [(job(fresh, "0", [(7, "ok")], [22.95], 40.0, plain_phase=True), [(7, "ok")])], 7, None)
    machine = {"gpus": ["NVIDIA H100 80GB HBM3, 81559 MiB"]}
    runs = [{"machine": machine, "steps": [{"name": "llama24_tp2"}, {"name": "llama24_tp2_fresh"}]}]
    (tmp_path / "campaign.json").write_text(json.dumps({"runs": runs}))
    (row,) = search_cost.measured_rows("llama24_tp2", ())
    assert (row["gpu"], row["guess"], row["committed"]) == ("NVIDIA H100 80GB HBM3", 8, None)
    peak = lambda gib: int(gib * GIB) + 2**20  # noqa: E731
    assert row["in_load"] == [
        {"batch": 7, "after": "8 oom", "cache_emptied": True, "status": "ok", "reserved_in_process": peak(22.94),
         "status_fresh": "ok", "reserved_fresh": peak(22.95), "fresh_from": "llama24_tp2_fresh"}
    ]  # fmt: skip


def test_a_folder_resumed_on_another_machine_names_each_configurations_own_gpu(search_cost, tmp_path):
    one = tmp_path / "gpu24_one_load"
    ran = [(2, "ok"), (3, "oom")]
    search(one, [(job(one, "0", ran, [23.0, 23.2], 40.0), ran)], 2, 3)
    result = json.loads((one / "0" / "result.json").read_text())
    (one / "0" / "result.json").write_text(json.dumps({**result, "started": 150.0}))
    runs = [
        {"started": 100.0, "machine": {"gpus": ["NVIDIA H100 80GB HBM3, 81559 MiB"]}, "steps": [{"name": one.name}]},
        {"started": 200.0, "machine": {"gpus": ["NVIDIA H200, 143771 MiB"]}, "steps": [{"name": one.name}]},
    ]
    (tmp_path / "campaign.json").write_text(json.dumps({"runs": runs}))
    (row,) = search_cost.measured_rows(one.name, ())
    assert row["gpu"] == "NVIDIA H100 80GB HBM3"  # its job started before the H200's run
    assert search_cost.gpu_of(one.name) == "NVIDIA H200"  # the step's latest run
