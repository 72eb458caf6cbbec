"""Where a capped GPU runs out: the allocator replayed with frees against what the H200 recorded, and the meta-device
trace of a generate replayed under the cap against the brackets the H200 measured (results/h200/fragmentation:
llama_20b_shapes, tp=1, prompt 2048 + 8 new tokens, 48 GiB)."""

from __future__ import annotations

import gzip
import json

import pytest
import yaml

from dsexp.predict.allocator import Allocator

from helpers.run import ROOT

H200 = ROOT / "results" / "h200" / "fragmentation"
GIB, MIB = 2**30, 2**20
LLAMA_20B = yaml.safe_load((ROOT / "conf" / "model" / "llama_20b_shapes.yaml").read_text())["dims"]


def measured(name: str):
    return {p["batch"]: p for p in json.loads((H200 / name).read_text())["points"]}


def cuda_events(batch: int):
    """The allocator's own events the H200 recorded: the weights', then that batch's generate's."""
    trace = json.loads(gzip.open(H200 / f"trace_b{batch}.json.gz", "rt").read())
    out = []
    for action, size, addr in trace["weights"] + trace["generate"]:
        if action == "alloc":
            out.append(("alloc", addr, size))
        elif action == "free_requested":
            out.append(("free", addr, 0))
    return out


@pytest.mark.parametrize("batch", [4, 12])
def test_the_replay_of_what_the_h200_allocated_and_freed_reserves_what_it_reserved(batch):
    """To the byte, once the 32 MiB cuBLAS workspace the first batch's call left allocated is counted (the traced
    batch ran after batches 1..B-1 in the same process)."""
    state = Allocator().run([("alloc", "cublas", 32 * MIB)] + cuda_events(batch))
    point = measured("probe_1-24.json")[batch]
    assert (state.peak_reserved, state.peak_allocated) == (point["reserved_peak"], point["allocated_peak"])


def test_a_batch_after_an_out_of_memory_one_peaks_as_in_a_fresh_process():
    """One load for the whole bisection: batches 14 (fits) and 15 (out of memory) run in a fresh process reserve the
    same bytes as in the process that ran 1..15 in turn, releasing each out-of-memory point's cache."""
    in_turn = measured("probe_1-24.json")
    for batch in (14, 15):
        fresh = measured(f"probe_{batch}.json")[batch]
        assert (fresh["status"], fresh["reserved_peak"]) == (in_turn[batch]["status"], in_turn[batch]["reserved_peak"])


@pytest.fixture(scope="module")
def llama_20b():
    from dsexp.predict import architecture as arch
    from dsexp.predict.fragmentation import apply_order

    model = arch.meta_model({"arch": "llama", "dims": LLAMA_20B}, "bf16")
    return model, apply_order(model)


def test_the_weights_replayed_in_to_empty_order_reserve_what_the_h200_reserved(llama_20b):
    _, weights = llama_20b
    weights_only = [e for e in cuda_events(4)[: len(weights)]]
    assert (
        Allocator().run([("alloc", i, n) for i, n in enumerate(weights)]).reserved
        == Allocator().run(weights_only).reserved
    )


def large_pool(events):
    """The allocations above 1 MiB and their frees, in order, as (kind, bytes): what the large pool is made of."""
    sizes, out = {}, []
    for kind, key, n in events:
        if kind == "alloc":
            sizes[key] = n
        n = sizes.get(key, 0)
        if n > MIB:
            out.append((kind, n))
    return out


@pytest.mark.parametrize("batch", [4, pytest.param(12, marks=pytest.mark.slow)])
def test_the_meta_trace_makes_the_large_requests_the_h200_made_in_its_order(llama_20b, batch):
    """transformers' generate on the meta device, read as the GPU reads its data (the all-ones mask dropped, SDPA
    causal with grouped-query heads, its output laid out as the query is), requests every block above 1 MiB that the
    H200's allocator was asked for, of the same size and in the same order with the same frees (4,716 events at batch
    4); replayed after the weights, it reserves what the H200 reserved within one small-pool segment (the requests
    of 1 MiB and less are not all traced: a random seed's, cuDNN's)."""
    from dsexp.predict.meta_trace import generate_events

    model, weights = llama_20b
    traced = generate_events(model, batch, 2048, 8)
    assert large_pool(traced) == large_pool(cuda_events(batch)[len(weights) :])
    replay = Allocator().run(
        [("alloc", "cublas", 32 * MIB)] + [("alloc", i, n) for i, n in enumerate(weights)] + traced
    )
    point = measured("probe_1-24.json")[batch]
    assert abs(replay.peak_reserved - point["reserved_peak"]) <= 2 * MIB
    assert abs(replay.peak_allocated - point["allocated_peak"]) <= MIB


@pytest.mark.parametrize("expandable, last_ok, measured_file", [(False, 14, "probe_1-24.json"),
                                                                 (True, 16, "probe_1-30_exp.json")])  # fmt: skip
def test_the_meta_trace_replayed_under_the_cap_finds_the_bracket_the_h200_measured(
    llama_20b, expandable, last_ok, measured_file
):
    """From the allocated bytes' answer (16 for both: they do not see fragmentation) the walk replays a generate per
    batch on the meta device: the default allocator runs out at 15 with room left, expandable segments at 17."""
    from dsexp.predict.fragmentation import largest_batch, point_calls

    model, weights = llama_20b
    found, probes = largest_batch(model, weights, 2048, point_calls(8), 48 * GIB, start=16, expandable=expandable)
    points = measured(measured_file)
    assert found == last_ok and points[last_ok]["status"] == "ok" and points[last_ok + 1]["status"] == "oom"
    assert len(probes) <= 3  # the prediction, and the batches next to it
    assert all(p.fits == (points[p.batch]["status"] == "ok") for p in probes)


def fresh(points, i: int) -> bool:
    """Whether a job's i-th point ran as a fresh process would: its first, or one recorded as starting with the
    allocator's state the load left (dsexp.rank.workloads.pipeline.as_load)."""
    return i == 0 or (points[i].get("start") or {}).get("as_load") is True


def committed_budget_configs():
    """(search, configuration label, tp) -> (config, largest batch that ran, smallest out of memory, whether both
    ran as fresh processes would, the sequences of its jobs' logits call (None: the point's batch)) of every committed
    H200 budget configuration that bracketed its batch. A one-load
    search run before each point started from the load's state (no `start` in its points) is left out: its points
    after the first ran on the cache the earlier ones left (benchmarks/search_cost.py sets them beside fresh ones)."""
    from dsexp.analysis.labels import config_label
    from dsexp.core.result import JobRecord

    found = {}
    for path in sorted((ROOT / "results/h200/budget").glob("gpu*/*/result.json")):
        r = json.loads(path.read_text())
        c = r["config"]
        points = [e for e in ((r.get("ranks") or [{}])[0].get("points") or []) if e["status"] in ("ok", "oom")]
        if not points or (c["generate"].get("bisect_from") is not None and not any("start" in e for e in points)):
            continue
        key = (path.parts[-3], config_label(c, workload=False), c["tp"])
        _, ran, logits_batch = found.get(key, (c, {}, None))
        for i, e in enumerate(points):
            ran[e["batch"]] = (e["status"], fresh(points, i))
        found[key] = (c, ran, logits_batch or JobRecord(r).logits_batch)
    out = {}
    for k, (c, ran, logits_batch) in found.items():
        ok = max((b for b, (status, _) in ran.items() if status == "ok"), default=None)
        oom = min((b for b, (status, _) in ran.items() if status == "oom"), default=None)
        if ok is not None and oom is not None:
            out[k] = (c, ok, oom, ran[ok][1] and ran[oom][1], logits_batch)
    return out


COMMITTED = committed_budget_configs()
# Four ranks sharing one GPU, each capped (24 GiB on the H200, 19 GiB on an H100): the replay reaches the cap below the
# bracket, releases its cached segments as c10 does and then holds more than the GPUs did, so it sits up to three
# batches below what ran (never above). Before the replay gave new segments the driver's top-down addresses it sat one
# above (8 where 7 ran, 10 where 9 ran): an answer that runs out of memory. The tp=1 and tp=2 brackets, and the
# H100's fp8 generate replayed event by event (test_the_replay_reserves_what_the_h100_reserved_for_an_fp8_generate),
# hold the address order; what the shared tp=4 runs did after their first release is not traced (no snapshot). At
# gpu24's trimmed batch 9 the replay's allocated peak is the GPU's (19.89 GiB) and its reserve 26.64 uncapped against
# the GPU's 20.71: in the point's second generate its 6.35 GiB logits request finds 7 GiB free but spread over segments
# holding live blocks. Campaign budget's step gpu19_tp4_snapshot records such a job's every allocator event.
SHARED_TP4_BELOW = 3
FAST = ("gpu24", "autotp/internlm2_20b_shapes/meta/init_inference/bf16/shared_gpu", 4)
BRACKETS = [  # every committed bracket, one of them in the default (fast) suite
    pytest.param(k, marks=() if k == FAST else pytest.mark.slow, id=f"{k[0]}-tp{k[2]}-{k[1].split('/')[2]}")
    for k in sorted(COMMITTED)
]


@pytest.mark.parametrize("key", BRACKETS)
def test_every_budget_bracket_the_h200_measured_is_replayed_nearer_than_the_allocated_bytes_say(key):
    """InternLM2 at 20B shapes, AutoTP at tp=2 and 4 with the ranks sharing the H200, each capped at 24 or 40 GiB:
    the busiest rank's point (its generate calls, the logits call of a job's first point included) traced on the
    model as that rank holds it (the trims' splits, the last position's logits) and replayed under the cap, with the
    allocator setting the configuration ran. Within one batch of the last that ran (the allocated bytes alone said up
    to 5 more), untrimmed, or trimmed where both ends of the bracket ran as fresh processes; trimmed, within two where
    an end ran after another point of its job on the cache that point left (the load-per-guess search ran a guess and
    the batch above in one job): 4 x 24 GiB tp=4 eager and sharded trimmed, where 9 ran out of memory after 8 (the
    replay: 10), and 2 x 40 GiB sharded trimmed, where 11 ran after 10 (the replay: 9). On that cache the H200 ran
    meta trimmed at 2 x 40 GiB to 12 where fresh processes ran to 10 (results/h200/budget/gpu40_one_load). Where the
    allocated bytes alone hit the bracket, the replay may sit one below: 4 x 19 GiB tp=4 trimmed on an H100 ran 7 after
    6 in one load, without the first point's logits call, where this replay (the logits call included, transformers
    5.24) says 6; traced with the measuring stack's transformers 5.17 and without that call it says 7 (docs/FINDINGS.md
    6e). Searched again with the call of one sequence (gpu19_tp4_first_sequence) it ran 6 / 7; this replay says 6."""
    from dsexp.engines.placement import RULES
    from dsexp.predict.job import Facts, largest_batch, outside, predict, replayed

    config, ran, failed, both_fresh, logits_batch = COMMITTED[key]
    pred = predict(config, RULES, Facts(device="cuda"))
    gpu = int(config["budget"]["gpu_gib"] * GIB)
    held = sum(outside(config, pred.strategy, pred.tp, RULES).values())
    allocated = largest_batch(pred, 2048, 8, gpu, held).largest_batch
    answer = replayed(pred, config, RULES, 2048, 8, gpu - held, {"largest_batch": allocated}, logits_batch)
    found = answer["expandable_segments" if pred.strategy.expandable_segments else "default"]["batch"]
    within = 1 if both_fresh or not pred.strategy.trims else 2
    if config["tp"] == 4:  # four ranks sharing the GPU, each past its cap before the bracket: see SHARED_TP4_BELOW
        assert ran - SHARED_TP4_BELOW <= found <= ran + within, (found, ran, failed, allocated)
        return
    assert abs(found - ran) <= within and abs(found - ran) <= max(abs(allocated - ran), 1), (
        found,
        ran,
        failed,
        allocated,
    )


def test_new_segments_take_the_addresses_the_h200s_driver_gave_them():
    """The driver's virtual addresses decide the allocator's ties (of two free blocks of one size, the lower is handed
    out): Addresses places every one of the 339 segments of the H200's 20B bf16 load where cudaMalloc did (each
    reservation 32 MiB granules below the last, a segment that fits a reservation's unused tail at its bottom)."""
    from dsexp.predict.allocator import VA_GRANULE, Addresses

    trace = json.loads(gzip.open(H200 / "trace_b12.json.gz", "rt").read())
    segments = [(addr, size) for action, size, addr in trace["weights"] if action == "segment_alloc"]
    addresses = Addresses()
    first, size = segments[0]
    addresses.low = first + -(-size // VA_GRANULE) * VA_GRANULE  # the first reservation's top, as the driver chose it
    placed = [addresses.take(size) for _, size in segments]
    assert len(segments) == 339 and placed == [addr for addr, _ in segments]


H100_FP8 = ROOT / "results" / "h200" / "quant" / "fp8_trace"


def test_the_replay_reserves_what_the_h100_reserved_for_an_fp8_generate():
    """llama_20b_shapes in fp8 (torchao, tp=1) on an H100, 35 x 2048 tokens + 16 new, recorded by PyTorch's memory
    snapshots (probe.memory_snapshot): from the segments the quantize phase left, the generate's 243,580 allocator
    events replayed reserve the GPU's peak within 2 MiB and allocate it to the byte. New segments at increasing
    addresses (the replay before) reused the oldest of three freed 1.64 GiB activations where the GPU reused the
    newest, and reserved 1.64 GiB less: it put fp8's largest batch under 60 GiB at 37, where 36 ran out of memory."""
    snap = json.loads(gzip.open(H100_FP8 / "fp8_b35_snapshots.json.gz", "rt").read())
    gpu = json.loads((H100_FP8 / "fp8_b35_result.json").read_text())["ranks"][0]["phases"]["generate"]["gpu"]
    events = []
    for action, addr, size, _ in snap["rank0_generate"]["events"]:
        if action == "alloc":
            events.append(("alloc", addr, size))
        elif action == "free_completed":
            events.append(("free", addr, 0))
    allocator = Allocator.from_segments(snap["rank0_quantize"]["segments"])
    state = allocator.run(events)
    assert state.peak_allocated == gpu["gpu_alloc_peak"]
    assert abs(state.peak_reserved - gpu["gpu_reserved_peak"]) <= 2 * MIB, (state.peak_reserved, gpu)
