"""The caching allocator's reserve for a rank's weights (dsexp.predict.allocator): its rules on made-up sizes, and
the replay against what every rank of the H200 runs reserved after init."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsexp.analysis.memory import predict
from dsexp.engines.placement import allocator_reserve
from dsexp.predict.allocator import LARGE_SEGMENT, SMALL_SEGMENT, replay

MIB = 2**20
SHARED = Path(__file__).resolve().parents[1] / "results" / "h200" / "shared"


def test_small_requests_share_2_mib_segments():
    r = replay([12 * 1024] * 100)  # 100 norm weights of 12 KiB: 1.2 MiB
    assert (r.reserved, r.allocated) == (SMALL_SEGMENT, 100 * 12 * 1024)


def test_requests_of_1_to_10_mib_pack_into_20_mib_segments():
    r = replay([8 * MIB] * 96)  # 48 layers' RoPE tables: two per segment, 4 MiB of each left
    assert r.reserved == 48 * LARGE_SEGMENT and r.allocated == 96 * 8 * MIB
    # a 9 MiB request takes the 11 MiB left by the first; the 2 MiB tail is split off for later
    assert replay([9 * MIB, 9 * MIB, 2 * MIB]).reserved == LARGE_SEGMENT


def test_large_requests_round_to_2_mib_and_small_tails_stay_with_the_block():
    r = replay([97 * MIB + 1])  # a tail of 1 MiB or less is not split off: the block is the whole segment
    assert r.reserved == 98 * MIB and r.allocated == 98 * MIB
    r = replay([96 * MIB + 1, 1536 * 1024])  # a longer one is split off and serves the next request that fits
    assert r.reserved == 98 * MIB and r.allocated == 98 * MIB  # (whole: under 1 MiB of it would be left)
    assert replay([96 * MIB + 1, 1536 * 1024, 1536 * 1024]).reserved == 98 * MIB + LARGE_SEGMENT
    assert replay([0, -1]).reserved == 0


def h200_runs():
    return sorted(SHARED.glob("autotp*/*/result.json"))


@pytest.mark.skipif(not h200_runs(), reason="no H200 records in results/h200/shared")
@pytest.mark.parametrize("path", h200_runs(), ids=lambda p: f"{p.parent.parent.name}/{p.parent.name}")
def test_replay_equals_what_every_h200_rank_reserved_after_init(path):
    res = json.loads(path.read_text())
    p = predict(res)
    init = [rk["phases"]["init"]["gpu"] for rk in sorted(res["ranks"], key=lambda r: r["rank"])]
    assert p.reserve == [g["gpu_reserved"] for g in init]
    replayed = [allocator_reserve(p.placements, r, p.strategy).allocated for r in range(p.tp)]
    assert replayed == [g["gpu_alloc"] for g in init]  # blocks: rounded tensors and their unsplit tails
    assert max(p.reserve) - max(p.weights) == p.segment_slack > 0


# The allocator with frees, hand-worked (MiB): best fit within a pool, split tails, merged neighbours, a cap


def run(events, cap=None, expandable=False):
    from dsexp.predict.allocator import Allocator

    return Allocator(cap * MIB if cap else None, expandable).run(
        [("alloc", k, int(v * MIB)) if v else ("free", k, 0) for k, v in events]
    )


def test_a_freed_block_is_split_for_a_smaller_request_and_its_tail_serves_the_next():
    state = run([("a", 12), ("a", 0), ("b", 4), ("c", 8)])  # a's own 12 MiB segment, then b and c inside it
    assert (state.reserved, state.allocated, state.peak_reserved) == (12 * MIB, 12 * MIB, 12 * MIB)


def test_freed_neighbours_merge_and_an_exact_fit_takes_the_lowest_address():
    # a, b, c of 4 MiB in one 20 MiB segment; a and b freed merge into 8 MiB, which an 8 MiB request takes whole
    state = run([("a", 4), ("b", 4), ("c", 4), ("a", 0), ("b", 0), ("d", 8), ("c", 0), ("e", 12)])
    assert state.reserved == 20 * MIB  # c freed merged with the 8 MiB tail: 12 MiB at address 8 for e
    assert state.allocated == 20 * MIB and state.oom is None


def test_a_request_too_large_for_every_cached_block_runs_out_under_the_cap_with_room_left():
    """a and b in segments of their own; c (2 MiB) splits a's; b freed. d (36 MiB) fits no block: the allocator frees
    b's whole segment and asks again, 12 + 36 > 40: out of memory with 2 MiB allocated (38 MiB would have fit)."""
    events = [("a", 12), ("b", 12), ("a", 0), ("c", 2), ("b", 0), ("d", 36)]
    state = run(events, cap=40)
    assert state.oom == (5, 36 * MIB) and state.allocated == 2 * MIB and state.reserved == 12 * MIB
    assert state.allocated + 36 * MIB <= 40 * MIB  # the bytes were there, split in a block too small
    assert run(events).oom is None and run(events).peak_reserved == 60 * MIB  # uncapped: a new segment


def test_expandable_segments_map_20_mib_pages_and_the_same_sequence_fits():
    """One growing segment: a maps a page (free tail 8 MiB), b maps one more, c reuses a's place, b freed merges the
    rest into 38 MiB free: d (36 MiB) fits in the 40 MiB mapped."""
    state = run([("a", 12), ("b", 12), ("a", 0), ("c", 2), ("b", 0), ("d", 36)], cap=40, expandable=True)
    assert state.oom is None and (state.reserved, state.allocated) == (40 * MIB, 38 * MIB)


def test_expandable_segments_unmap_free_pages_before_running_out():
    """a and b take a page each; a freed leaves a whole free page, which the allocator unmaps for c's two pages."""
    state = run([("a", 20), ("b", 20), ("a", 0), ("c", 40)], cap=60, expandable=True)
    assert state.oom is None and state.reserved == 60 * MIB and state.allocated == 60 * MIB
    assert run([("a", 20), ("b", 20), ("a", 0), ("c", 60)], cap=60, expandable=True).oom == (3, 60 * MIB)


def test_small_requests_round_to_512_bytes_and_share_a_2_mib_segment_reused_after_free():
    state = run([("a", 1000 / MIB), ("b", 1000 / MIB), ("a", 0), ("c", 900 / MIB)])
    assert (state.reserved, state.allocated) == (2 * MIB, 2048)  # c takes a's 1024-byte block
