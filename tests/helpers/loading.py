"""What a sharded load's record holds, whatever the model: checked by the loading and published-code sweeps."""

from __future__ import annotations


def assert_sharded(res, tp):
    """The split step ran once for this tp in the run dtype; each rank was built on meta and filled from its own
    file, reading exactly its share."""
    split = res["runtime"]["split"]
    assert f"-tp{tp}-bf16-" in split["dir"] and len(split["rank_bytes"]) == tp and split["seconds"] > 0
    assert res["runtime"]["conversion"] is None
    for rk in res["ranks"]:
        assert set(rk["phases"]["load"]["weights"]["param_bytes"]) == {"meta"}  # built on meta: nothing read yet
        assert rk["phases"]["load"]["loader"]["rank_files"][0].endswith(f"rank{rk['rank']:03d}-000.safetensors")
    fill = res["engine"]["finalize"]["fill"]
    assert fill["tensors"] > 0 and fill["bytes_read"] == split["rank_bytes"][0]
