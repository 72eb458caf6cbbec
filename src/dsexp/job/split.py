"""Job side of `load=sharded`: DeepSpeed's own AutoTP slices the model once, each rank saves its slice.

Run by the job before the measured ranks (so its cost is in no measured phase), cached on disk by a
key of everything that decides the slices: the checkpoint, tp, run dtype, engine and model policy
settings, and the DeepSpeed/transformers versions. The split ranks are the ordinary worker in role
"split": eager load, `init_inference` exactly as the measured run calls it, then each rank writes its
local `state_dict` (already in the run dtype) as safetensors files (`dsexp.rank.loading.slices`).

Why not DeepSpeed's `save_mp_checkpoint_path`: in 0.19.8 it writes `torch.save` files in the
`{"tp": [...], "non_tp": [...]}` layout that only the kernel-injection branch of
`replace_transformer_layer` reads back; the AutoTP branch iterates `checkpoint_dict["checkpoints"]`
as a list of full-model files and slices them again, so every rank would still read everything.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict
from importlib.metadata import version
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.core.fs import build_once
from dsexp.core.schema import JobConfig, QuantConfig, dtype_conversion
from dsexp.job.roles import role_spec, run_role
from dsexp.trims import TRIMS

SPLIT_VERSION = 2  # 2: the rank index names tied aliases (slices.save_rank_slice)
DONE_MARK = ".dsexp-split-complete.json"


def _checkpoint_identity(model_dir: Path) -> List[Any]:
    return sorted(
        (p.name, p.stat().st_size, int(p.stat().st_mtime))
        for p in Path(model_dir).iterdir()
        if p.is_file() and not p.name.startswith(".")
    )


def split_key(spec: JobConfig, model_dir: Path, stack: Optional[Dict[str, Any]] = None) -> str:
    """Everything that decides the slices, the software that cuts them included (a stack's pins, else the job
    environment's DeepSpeed and transformers)."""
    pins = (stack or {}).get("pins")
    software = {"stack": pins} if pins else {"deepspeed": version("deepspeed"), "transformers": version("transformers")}
    blob = json.dumps(
        {
            "checkpoint": [str(Path(model_dir).resolve()), _checkpoint_identity(model_dir)],
            "tp": spec.tp,
            "dtype": spec.dtype,
            "engine": asdict(spec.engine),
            "model_policy": spec.model.injection_policy,
            # the trims that change which slices a rank keeps (the others change no saved tensor)
            "trim": {k: getattr(spec.trim, k) for k, t in TRIMS.items() if t.changes_slices and getattr(spec.trim, k)},
            **software,
            "v": SPLIT_VERSION,
        },
        sort_keys=True,
        default=str,
    )
    return hashlib.sha1(blob.encode()).hexdigest()[:12]


def split_dir(spec: JobConfig, model_dir: Path, stack: Optional[Dict[str, Any]] = None) -> Path:
    root = Path(spec.load.shard_dir or Path(spec.cache_dir) / "shards").expanduser()
    return root / f"{spec.model.name}-tp{spec.tp}-{spec.dtype}-{split_key(spec, model_dir, stack)}"


def ensure_split(spec: JobConfig, runtime: Dict[str, Any], job_dir: Path) -> Dict[str, Any]:
    """The per-rank files for this job, split now (tp ranks, DeepSpeed AutoTP) if no complete copy is cached."""
    final = split_dir(spec, Path(runtime["model_dir"]), runtime.get("stack"))

    def build(tmp: Path) -> Dict[str, Any]:
        tmp.mkdir()
        t0 = time.perf_counter()
        run_role(
            # the slices in the run dtype, as the engine cut them: a quant member quantizes them after each run's load
            # (saving torchao's tensors failed: safetensors reads a plain storage), so its key names no member
            role_spec(spec, quant=QuantConfig()),
            runtime,
            job_dir / "split",
            "split",
            "the split run",
            extra={"split_out": str(tmp)},
            missing=lambda r: None if (tmp / f"rank{r:03d}.json").is_file() else f"no rank{r:03d}.json in {tmp}",
        )
        return {
            "seconds": time.perf_counter() - t0,
            "rank_bytes": [json.loads((tmp / f"rank{r:03d}.json").read_text())["bytes"] for r in range(spec.tp)],
        }

    done, hit = build_once(final, DONE_MARK, build)
    return {"dir": str(final), "cache_hit": hit, "conversion": dtype_conversion(spec.model.dtype, spec.dtype), **done}
