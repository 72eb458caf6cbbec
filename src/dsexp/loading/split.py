"""The split step of `load=sharded`: DeepSpeed's own AutoTP slices the model once, each rank saves its slice.

Run by the job before the measured ranks (so its cost is in no measured phase), cached on disk by a
key of everything that decides the slices: the checkpoint, tp, run dtype, engine and model policy
settings, and the DeepSpeed/transformers versions. The split ranks are the ordinary worker in role
"split": eager load, `init_inference` exactly as the measured run calls it, then each rank writes its
local `state_dict` (already in the run dtype) as safetensors files of at most CHUNK_BYTES.

Why not DeepSpeed's `save_mp_checkpoint_path`: in 0.19.8 it writes `torch.save` files in the
`{"tp": [...], "non_tp": [...]}` layout that only the kernel-injection branch of
`replace_transformer_layer` reads back; the AutoTP branch iterates `checkpoint_dict["checkpoints"]`
as a list of full-model files and slices them again, so every rank would still read everything.
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List


from dsexp.config import JobConfig
from dsexp.context import RankContext
from dsexp.loading.base import dtype_conversion
from dsexp.records import build_once

SPLIT_VERSION = 1
CHUNK_BYTES = 1 << 30  # bounds host memory while a GPU rank copies its slice out for saving
DONE_MARK = ".dsexp-split-complete.json"


def _checkpoint_identity(model_dir: Path) -> List[Any]:
    return sorted((p.name, p.stat().st_size, int(p.stat().st_mtime)) for p in Path(model_dir).iterdir()
                  if p.is_file() and not p.name.startswith("."))


def split_key(spec: JobConfig, model_dir: Path) -> str:
    blob = json.dumps({"checkpoint": [str(Path(model_dir).resolve()), _checkpoint_identity(model_dir)],
                       "tp": spec.tp, "dtype": spec.dtype, "engine": asdict(spec.engine),
                       "model_policy": spec.model.injection_policy, "deepspeed": version("deepspeed"),
                       "transformers": version("transformers"), "v": SPLIT_VERSION}, sort_keys=True, default=str)
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def split_dir(spec: JobConfig, model_dir: Path) -> Path:
    root = Path(spec.load.shard_dir or Path(spec.cache_dir) / "shards").expanduser()
    return root / f"{spec.model.name}-tp{spec.tp}-{spec.dtype}-{split_key(spec, model_dir)}"


def rank_files(shard_dir: Path, rank: int) -> List[Path]:
    index = json.loads((Path(shard_dir) / f"rank{rank:03d}.json").read_text())
    return [Path(shard_dir) / f for f in index["files"]]


def ensure_split(spec: JobConfig, runtime: Dict[str, Any], job_dir: Path) -> Dict[str, Any]:
    """The per-rank files for this job, split now (tp ranks, DeepSpeed AutoTP) if no complete copy is cached."""
    final = split_dir(spec, Path(runtime["model_dir"]))

    def build(tmp: Path) -> Dict[str, Any]:
        tmp.mkdir()
        t0 = time.perf_counter()
        _run_split(spec, runtime, job_dir / "split", tmp)
        return {"seconds": time.perf_counter() - t0,
                "rank_bytes": [json.loads((tmp / f"rank{r:03d}.json").read_text())["bytes"] for r in range(spec.tp)]}

    done, hit = build_once(final, DONE_MARK, build)
    return {"dir": str(final), "cache_hit": hit, "conversion": dtype_conversion(spec), **done}


def _run_split(spec: JobConfig, runtime: Dict[str, Any], run_dir: Path, out: Path) -> None:
    from dsexp import failures, records
    from dsexp.job import _write_job_file
    from dsexp.launch import run_ranks

    split_spec = replace(spec, fault=None, launcher=replace(spec.launcher, name="torchrun"))
    run_dir.mkdir(parents=True, exist_ok=True)
    _write_job_file(run_dir, split_spec, {**runtime, "role": "split", "split_out": str(out)})
    outcome = run_ranks(split_spec, run_dir, runtime["device"])
    for r in range(spec.tp):
        rec = records.read_json(records.rank_file(run_dir, r))
        if outcome.returncode != 0 or not rec or rec.get("status") != "ok" or not (out / f"rank{r:03d}.json").is_file():
            raise RuntimeError(f"the split run failed on rank {r} (see {run_dir}): "
                               f"{(rec or {}).get('error') or failures.tail(run_dir / 'ranks' / f'rank{r}.log', 10)}")


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
