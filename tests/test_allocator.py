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
