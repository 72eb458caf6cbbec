"""Ask before you run: every committed H200 configuration, re-predicted by `python -m dsexp.plan` from its config
alone, says what the report said of the run after it ran.

What this holds: the plan and the report are two routes to one memory model (dsexp.predict), the plan's from the
overrides through Hydra's composition, the report's from the run's result.json. Byte equality says the two routes
reach the same inputs (the same configuration, workload and model facts), not that the model is right: its figures
against the H200's measurements are checked in tests/test_capacity_report.py (within 5% of every point that ran)
and tests/test_floor.py (never above a measured peak).

The plan composes each sweep's own overrides (its multirun.yaml; a budget search's configuration: the overrides its
budget.json lists, at the batches its jobs ran) through dsexp.compose.planning, as `python -m dsexp.plan` does. The
report predicts each committed result.json (dsexp.analysis.memory.predict: the run's facts, its tokenized prompt
length) and sets the capacity terms at each point it measured (dsexp.predict.capacity.above_weights). The two must
agree to the byte: weights per rank, and the bytes above the weights per rank at every point.

The largest batch of a budget search: the plan's (the budget's gpu_gib, the ranks' memory outside the allocator) is
set beside the bracket the search measured. It is not asserted inside the bracket: the model counts allocated bytes,
not the allocator's fragmentation (a known gap: at 2 x 40 GiB it says 16 where 11 was measured), so it is a floor of
the memory and its batch is at least the largest that ran. The figures are in benchmarks/plan_vs_llm_analysis.py.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any, Dict, List, Tuple

import pytest
from omegaconf import OmegaConf

from dsexp.analysis.memory import predict as report_prediction
from dsexp.compose.planning import plan_one, space
from dsexp.core.result import JobRecord
from dsexp.predict import capacity as cap
from test_fragmentation import BRACKETS, COMMITTED, GIB, SHARED_TP4_BELOW

ROOT = Path(__file__).resolve().parents[1]
CAPACITY = ROOT / "results" / "h200" / "capacity"
BUDGET = ROOT / "results" / "h200" / "budget"


def sweep_overrides(folder: Path) -> List[str]:
    """The overrides the sweep was started with (Hydra's multirun.yaml)."""
    return list(OmegaConf.load(folder / "multirun.yaml").hydra.overrides.task)


def job_results(folder: Path) -> Dict[int, Dict[str, Any]]:
    """{job number: result.json} of a sweep folder."""
    return {int(p.parent.name): json.loads(p.read_text()) for p in folder.glob("*/result.json")}


def sweeps(root: Path, marker: str, ran: bool = True) -> List[str]:
    """The sweep folders holding `marker` (with a job that ran, unless ran=False)."""
    return sorted(p.parent.name for p in root.glob(f"*/{marker}") if not ran or list(p.parent.glob("*/result.json")))


@functools.lru_cache(maxsize=None)
def planned(overrides: Tuple[str, ...], multirun: bool) -> List[Dict[str, Any]]:
    """What `python -m dsexp.plan --no-replay [-m] <overrides>` says: every configuration's entry (the allocated
    bytes' figures these tests hold; the replay's answer is held below, and in tests/test_fragmentation.py)."""
    entries = [plan_one(p, replay=False) for p in space(list(overrides), multirun)]
    assert entries and all(e["status"] == "predicted" for e in entries), [e.get("reason") for e in entries]
    return entries


def measured_points(result: Dict[str, Any]) -> List[Tuple[int, int]]:
    """(batch, prompt length as the ranks tokenized it) of every point rank 0 listed; with generate.prompt_tokens set
    the length is that number."""
    rank0 = next(iter(JobRecord.of(result).ranks), None)
    out = []
    for entry in rank0.points if rank0 else ():
        length = rank0.phase(entry["phase"]).point.get("prompt_len") or entry.get("prompt_tokens")
        assert length == entry["prompt_tokens"], (entry, length)  # the workload the plan predicts is the run's
        out.append((int(entry["batch"]), int(length)))
    return out


def assert_plan_is_the_report(entry: Dict[str, Any], result: Dict[str, Any], where: str) -> int:
    """Weights per rank and the bytes above them at each of the run's points, plan against report; the points
    checked."""
    report = report_prediction(result)
    assert [r["weights_bytes"] for r in entry["per_rank"]] == report.weights, where
    new = int(result["config"]["generate"]["new_tokens"])
    by_point: Dict[Tuple[int, int, int], List[int]] = {}
    for rank in entry["per_rank"]:
        for p in rank["points"]:
            by_point.setdefault((p["batch"], p["prompt_tokens"], p["new_tokens"]), []).append(p["above_weights_bytes"])
    points = measured_points(result)
    for batch, length in points:
        terms = cap.above_weights(report.dims, report.strategy, report.tp, cap.Workload(batch, length, new))
        expected = [sum(v[r] for v in terms.values()) for r in range(report.tp)]
        assert by_point[(batch, length, new)] == expected, (where, batch, length)
    return len(points)


def some_by_default(names: List[str], default: Tuple[str, ...]) -> list:
    """The names as parameters, those not in `default` under the slow mark: the composition route is the same code
    for each folder, so the default run checks one of each model, load strategy and trim (make test-all: all)."""
    return [pytest.param(n, marks=() if n in default else pytest.mark.slow) for n in names]


@pytest.mark.parametrize("sweep", some_by_default(sweeps(CAPACITY, "multirun.yaml"), ("internlm2_tp2", "llama_tp1")))
def test_the_plan_composes_a_capacity_grid_into_the_inputs_the_report_predicted_from(sweep):
    """results/h200/capacity/<sweep>: Llama and InternLM2 at 20B shapes, tp=1,2,4, a grid of batch x prompt tokens
    in one job; the plan of the campaign's overrides has every point of the grid."""
    folder = CAPACITY / sweep
    (entry,) = planned(tuple(sweep_overrides(folder)), True)
    results = job_results(folder)
    assert results
    checked = sum(assert_plan_is_the_report(entry, r, f"{sweep}/{n}") for n, r in results.items())
    assert checked >= 6


def budget_configs(folder: Path) -> List[Tuple[Dict[str, Any], Dict[int, Dict[str, Any]]]]:
    """Each configuration of a budget search (budget.json) with the results of the jobs that ran it."""
    search = json.loads((folder / "budget.json").read_text())
    results = job_results(folder)
    job_config = {int(Path(j["dir"]).name): j["config"] for j in search["jobs"]}
    assert set(results) == set(job_config), folder.name  # every committed job is one the search made
    return [(c, {n: r for n, r in results.items() if job_config[n] == c["key"]}) for c in search["configs"]]


@pytest.mark.parametrize(
    "sweep",
    some_by_default(
        sweeps(BUDGET, "budget.json"), ("gpu19_tp4_one_load", "gpu24_loads_tp2", "gpu40_expandable", "llama24_tp2")
    ),
)
def test_the_plan_composes_a_budget_searchs_runs_into_the_inputs_the_report_predicted_from(sweep):
    """results/h200/budget/<sweep>: each configuration the search ran, composed from its own overrides at the
    batches its jobs ran (jobs cut short included: their weights were predicted too)."""
    checked = 0
    for config, results in budget_configs(BUDGET / sweep):
        if not results:
            continue
        batches = sorted({b for r in results.values() for b, _ in measured_points(r)})
        overrides = list(config["overrides"])
        if batches:  # jobs cut short before a point: the search's own batch then
            overrides.append(f"generate.batch_size=[{','.join(map(str, batches))}]")
        (entry,) = planned(tuple(overrides), False)
        checked += sum(assert_plan_is_the_report(entry, r, f"{sweep}/{n}") for n, r in results.items())
    assert checked >= 1


def plan_of_config(entries: List[Dict[str, Any]], config: Dict[str, Any]) -> Dict[str, Any]:
    """The entry of the sweep's plan whose varied overrides are this configuration's dimensions."""
    want = {f"{k}={v}" for k, v in config["dims"].items()}
    (entry,) = [e for e in entries if want <= set(e["overrides"])]
    return entry


@pytest.mark.parametrize("sweep", sweeps(BUDGET, "budget.json", ran=False))
def test_the_plans_largest_batch_is_at_least_the_largest_the_budget_search_ran(sweep):
    """`python -m dsexp.plan -m <the search's overrides>` at the budget's GPU size: its largest batch at the prompt
    length is a floor's answer, at least the largest batch that ran under the cap (fragmentation, not modelled, is
    why it may exceed the smallest that ran out of memory: not asserted). A configuration the search did not launch
    (predicted not to fit) has nothing measured."""
    folder = BUDGET / sweep
    search = json.loads((folder / "budget.json").read_text())
    entries = planned(tuple(sweep_overrides(folder)), True)
    length = str(search["prompt_tokens"])
    # the search's allocator twins (expandable segments, added where fragmentation decided a bracket) are no entry of
    # the sweep's plan: each is planned from its own overrides, the environment line among them
    twins = [c for c in search["configs"] if c.get("twin_of")]
    assert len(entries) == len(search["configs"]) - len(twins)
    for config in search["configs"]:
        entry = planned(tuple(config["overrides"]), False)[0] if config in twins else plan_of_config(entries, config)
        assert entry["gpu_budget_bytes"] == search["budget"]["device"]
        largest = entry["largest_batch"][length]["allocated_bytes_bound"]
        ran = config["largest_ok"]
        assert ran is None or largest >= ran, (sweep, config["key"], largest, ran, config["smallest_oom"])


@pytest.mark.parametrize("key", BRACKETS)
def test_the_default_plans_largest_batch_for_every_committed_h200_bracket_is_the_replays_within_it(key):
    """`python -m dsexp.plan` as a user runs it (no flag) at each committed H200 budget bracket's configuration and GPU
    size: the largest batch it gives is the caching allocator replay's, not the allocated bytes' bound (never above
    it), and it sits within the bracket as tests/test_fragmentation.py holds the replay: one batch of the last that
    ran, two where a trimmed end ran after another point of its job. The plan replays today's pipeline, whose
    correctness check's logits call runs the first sequence alone; where the bracket's jobs ran that call on the
    point's whole batch (the searches before it: more logits at once), the plan may say more, never less: at 2 x 40
    GiB untrimmed they ran 9 and ran out at 10; the plan says 11, and the same configurations searched again with
    today's call (gpu40_from_load) ran 11 and ran out at 12."""
    from dsexp.core.workload import CHECK_BATCH
    from dsexp.engines.placement import RULES
    from dsexp.predict.capacity import Workload
    from dsexp.predict.job import Facts, plan_entry, predict

    config, ran, failed, both_fresh, logits_batch = COMMITTED[key]
    pred = predict(config, RULES, Facts(device="cuda"))
    entry = plan_entry(pred, config, RULES, [Workload(1, 2048, 8)], int(config["budget"]["gpu_gib"] * GIB))
    fit = entry["largest_batch"]["2048"]
    setting = "expandable_segments" if pred.strategy.expandable_segments else "default"
    found = fit["largest_batch"]
    assert fit["answer_from"] == f"replay:{setting}" and found == fit["replayed"][setting]["batch"]
    within = 1 if both_fresh or not pred.strategy.trims else 2
    above = within if logits_batch == CHECK_BATCH else fit["allocated_bytes_bound"] - ran
    below = SHARED_TP4_BELOW if config["tp"] == 4 else within  # (tests/test_fragmentation.py says why)
    assert ran - below <= found <= ran + above and found <= fit["allocated_bytes_bound"], (found, ran, failed)


QUANT60 = ROOT / "results" / "h200" / "quant" / "budget60_each"


def quant60_configs() -> List[Dict[str, Any]]:
    search = json.loads((QUANT60 / "budget.json").read_text())
    return [c for c in search["configs"] if c.get("largest_ok") is not None and c.get("smallest_oom") is not None]


QUANT60_CASES = [
    pytest.param(c, marks=() if c["key"] == "quant=fp8" else pytest.mark.slow, id=c["key"]) for c in quant60_configs()
]


@pytest.mark.parametrize("config", QUANT60_CASES)
def test_the_plans_largest_batch_of_each_quant_member_under_60_gib_is_within_one_of_the_h100s(config):
    """The one-load search of every quantization member at 60 GiB on an H100 (campaign quant, budget60_each: fp8 ran
    35 and ran out at 36, int8_weight 55 / 56, bf16 29 / 30, int4_weight 64 under its kernel's limit, and with
    expandable segments fp8 41, int8_weight 59, bf16 33): `python -m dsexp.plan` with the search's overrides gives its
    default answer (the caching allocator's replay of the quantized model; int4's allocated bytes and kernel limit)
    within one batch of the largest that ran."""
    (entry,) = [plan_one(p) for p in space(list(config["overrides"]), False)]
    found = entry["largest_batch"]["2048"]["largest_batch"]
    assert abs(found - config["largest_ok"]) <= 1, (config["key"], found, config["largest_ok"], config["smallest_oom"])


@pytest.mark.slow
def test_int4s_replayed_generate_peaks_as_the_h100s_did_at_64_sequences():
    """int4_weight at tp=1, 64 x 2048 tokens + 16 new under 60 GiB on the H100 (budget60_each, job 12): the replay of
    the rank quantized on the meta device (tinygemm's packed weights, its product's output) allocates the GPU's peak
    within 0.1% and, under the job's allocator cap (which both reach, then release their cache), reserves it within
    0.5% (uncapped the replay would reserve 61.24 GiB)."""
    from dsexp.core.result import JobRecord
    from dsexp.engines.placement import RULES
    from dsexp.predict import fragmentation as F
    from dsexp.predict.job import Facts, predict, replay_model

    result = json.loads((QUANT60 / "12" / "result.json").read_text())
    config, gpu = result["config"], result["ranks"][0]["phases"]["generate[b=64,l=2048]"]["gpu"]
    pred = predict(config, RULES, Facts(device="cuda"))
    ranked, weights, why = replay_model(pred, config, RULES)
    assert ranked is not None, why
    calls = F.point_calls(16, 0, 1, True, JobRecord(result).logits_batch)
    cap = result["ranks"][0]["budget"]["cap_bytes"]  # the GPU's allocator cap: it released its cache there
    probe = F.probe(ranked, weights, 64, 2048, calls, cap)
    assert probe.fits
    assert abs(probe.peak_allocated / gpu["gpu_alloc_peak"] - 1) < 0.001, (probe, gpu)
    assert abs(probe.peak_reserved / gpu["gpu_reserved_peak"] - 1) < 0.005, (probe, gpu)
