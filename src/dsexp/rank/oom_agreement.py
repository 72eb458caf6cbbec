"""A workload point that runs out of memory at tp>1: may the ranks go on to the next point together?

Before a point's forward (a simulated budget, a test fault) no rank is in a collective yet: one all_reduce tells
every rank which ran out, and they go on together. Inside the forward it is different: a rank that catches
torch.OutOfMemoryError has left the forward somewhere, and a peer that did not run out waits in the forward's next
collective, which this rank would never join (a collective to agree would pair with that one: a hang, or mixed
data). So the ranks that ran out agree out of band, through the process group's store: each posts its collective
counts and waits up to `wait_s` for the others. Every rank out of memory with the same counts (a symmetric OOM:
AutoTP's ranks hold the same shapes): they go on. Otherwise the ranks end: the first verdict posted wins (a
compare-and-set), each rank that ran out records the point and exits (RanksEnded), the launcher stops its peers,
and the job relaunches the ranks for the points left (dsexp.job.oom_relaunch).
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any, Dict, List, Optional, Tuple

GO_ON, END = "go_on", "end"


class RanksEnded(Exception):
    """This rank ran out of memory where its peers could not follow: the job's ranks end here (the worker exits
    non-zero after recording, so the launcher stops the others)."""


def ranks_out_before_forward(world_size: int, rank: int, mine: bool, device: str) -> List[int]:
    """The ranks out of memory before the point's forward, the same list on every rank (one all_reduce: no rank
    is in another collective yet)."""
    if world_size == 1:
        return [0] if mine else []
    import torch

    flags = torch.zeros(world_size, dtype=torch.int32, device=device)
    flags[rank] = int(mine)
    torch.distributed.all_reduce(flags)
    return [r for r, f in enumerate(flags.tolist()) if f]


def collective_counts() -> Optional[Dict[str, int]]:
    """How many collectives this rank issued in each of its process groups (their sequence numbers); None where
    torch cannot tell. NCCL returns from a collective before its peers join, so equal counts are what shows that
    no rank left a collective behind."""
    from torch.distributed import distributed_c10d as c10d

    try:
        return {name: int(pg._get_sequence_number_for_group()) for pg, name in c10d._world.pg_names.items()} or None
    except Exception:
        return None


def agree_after_forward(
    rank: int, world_size: int, key: str, wait_s: float, store=None, counts: Optional[Dict[str, int]] = None
) -> Tuple[bool, List[int]]:
    """(whether the ranks go on, the ranks that posted an out-of-memory error at this point) through `store` (the
    process group's) and this rank's collective `counts` (the process groups' sequence numbers)."""
    if world_size == 1:
        return True, [0]
    from torch.distributed import DistError
    from torch.distributed import distributed_c10d as c10d

    keys = [f"dsexp/oom/{key}/{r}" for r in range(world_size)]
    try:
        store = c10d._get_default_store() if store is None else store
        store.set(keys[rank], json.dumps(collective_counts() if counts is None else counts))
        try:
            store.wait(keys, timedelta(seconds=wait_s))
            counts = [json.loads(store.get(k)) for k in keys]
            proposal = GO_ON if counts[0] is not None and all(c == counts[0] for c in counts) else END
        except DistError:  # a peer did not run out: it waits in the forward
            proposal = END
        verdict = store.compare_set(f"dsexp/oom/{key}/verdict", "", proposal).decode()
        return verdict == GO_ON, [r for r, k in enumerate(keys) if store.check([k])]
    except DistError:  # the store is gone (its host rank finished): the peers cannot follow either
        return False, [rank]


def ended_record(rank: int, key: str, point: Dict[str, Any], ran_out: List[int]) -> Dict[str, Any]:
    """What the rank record's `ended` says when this rank ends the ranks after its out-of-memory error."""
    return {
        "how": "oom",
        "rank": rank,
        "phase": key,
        "point": point,
        "oom_ranks": ran_out,
        "message": f"rank {rank} ran out of memory at {key} (ranks out of memory there: {ran_out}); a peer could not "
        "follow it out of the forward, so it ended the job's ranks",
    }
