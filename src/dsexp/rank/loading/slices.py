"""This rank's slice of a `load=sharded` checkpoint: saved by the split role, read back by the sharded loader.

The job's split step (`dsexp.job.split`) runs the worker in role "split" on tp ranks; after init each rank
writes its local `state_dict` (already in the run dtype) as safetensors files of at most CHUNK_BYTES, plus
an index `rank{NNN}.json`. A tensor shared under several names (a tied head) is saved once; the index names its
aliases, so the sharded loader can tie them again where the engine's placement (`to_empty`) untied them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from dsexp.core.context import RankContext

CHUNK_BYTES = 1 << 30  # bounds host memory while a GPU rank copies its slice out for saving


def rank_index(shard_dir: Path, rank: int) -> Dict[str, Any]:
    """This rank's index: its files (paths), and `tied`: {name: the name it was saved under} for tensors the
    split's model shared under several names (a tied head, saved once)."""
    index = json.loads((Path(shard_dir) / f"rank{rank:03d}.json").read_text())
    return {**index, "files": [Path(shard_dir) / f for f in index["files"]], "tied": index.get("tied") or {}}


def save_rank_slice(module, ctx: RankContext) -> Dict[str, Any]:
    """Rank side: write this rank's state_dict (tied tensors once) as safetensors chunks plus an index."""
    import torch
    from safetensors.torch import save_file

    out = Path(ctx.runtime["split_out"])
    seen: Dict[int, str] = {}
    tied: Dict[str, str] = {}
    chunks, chunk, size = [], {}, 0
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor):
            continue
        if id(t) in seen:
            tied[name] = seen[id(t)]
            continue
        seen[id(t)] = name
        if chunk and size + t.numel() * t.element_size() > CHUNK_BYTES:
            chunks.append(chunk)
            chunk, size = {}, 0
        chunk[name] = t
        size += t.numel() * t.element_size()
    chunks.append(chunk)
    names, total = [], 0
    for i, part in enumerate(chunks):
        fname = f"rank{ctx.rank:03d}-{i:03d}.safetensors"
        host = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in part.items()}
        save_file(host, str(out / fname), metadata={"format": "pt"})
        total += sum(v.numel() * v.element_size() for v in host.values())
        names.append(fname)
        del host
    index = {"files": names, "tensors": len(seen), "bytes": total, "dtype": ctx.spec.dtype, "tied": tied}
    (out / f"rank{ctx.rank:03d}.json").write_text(json.dumps(index))
    return index
