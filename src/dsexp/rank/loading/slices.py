"""This rank's slice of a `load=sharded` checkpoint: saved by the split role, read back by the sharded loader.

The job's split step (`dsexp.job.split`) runs the worker in role "split" on tp ranks; after init each rank
writes its local `state_dict` (already in the run dtype) as safetensors files of at most CHUNK_BYTES, plus
an index `rank{NNN}.json`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

from dsexp.rank.context import RankContext

CHUNK_BYTES = 1 << 30  # bounds host memory while a GPU rank copies its slice out for saving


def rank_files(shard_dir: Path, rank: int) -> List[Path]:
    index = json.loads((Path(shard_dir) / f"rank{rank:03d}.json").read_text())
    return [Path(shard_dir) / f for f in index["files"]]


def save_rank_slice(module, ctx: RankContext) -> Dict[str, Any]:
    """Rank side: write this rank's state_dict (tied tensors once) as safetensors chunks plus an index."""
    import torch
    from safetensors.torch import save_file

    out = Path(ctx.runtime["split_out"])
    seen, chunks, chunk, size = set(), [], {}, 0
    for name, t in module.state_dict(keep_vars=True).items():
        if not isinstance(t, torch.Tensor) or id(t) in seen:
            continue
        seen.add(id(t))
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
    index = {"files": names, "tensors": len(seen), "bytes": total, "dtype": ctx.spec.dtype}
    (out / f"rank{ctx.rank:03d}.json").write_text(json.dumps(index))
    return index
