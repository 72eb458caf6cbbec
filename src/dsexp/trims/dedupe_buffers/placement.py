"""trim.dedupe_buffers in the memory model: which of the model's buffers share an identical one (the ranks' rule, on
the model built with real buffers), and those buffers' placements, which take no bytes of their own."""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path
from typing import Any, Dict, List, Optional

from dsexp.core.fs import write_json_atomic
from dsexp.predict import architecture as arch
from dsexp.predict.placements import Placement
from dsexp.trims.dedupe_buffers import TRAITS, duplicate_buffers


def shared_buffers(source: Dict[str, Any], s) -> Optional[Dict[str, str]]:
    """With the trim on, the buffers that share an identical one (`duplicates`); else None."""
    return duplicates(source, s.dtype) if s.trimmed(TRAITS.key) else None


def duplicates(source: Dict[str, Any], dtype: str) -> Dict[str, str]:
    """{buffer name: the first identical one} among the model's non-persistent buffers, by the rule the ranks share
    them by. The model is built with real buffers (parameters on meta) and their values compared: this costs the
    buffers' memory and time while it runs (0.75 GiB and ~10 s on 2 cores at InternLM2-20B shapes), so the answer is
    kept on disk once per model (`kept`): a plan asks again in milliseconds."""
    key = json.dumps(source, sort_keys=True)
    path = kept(key, dtype, source)
    if path is not None and path.is_file():
        return dict(json.loads(path.read_text()))
    found = dict(_duplicates(key, dtype))
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, found, fsync=False)
    return found


def kept(key: str, dtype: str, source: Dict[str, Any]) -> Optional[Path]:
    """Where the comparison's answer for this model is kept: dsexp's cache folder (DSEXP_CACHE, else
    ~/.cache/dsexp), keyed by the source, the dtype and the content of its code and config.json (a folder's, or a
    preset's shipped code); None where that content cannot be read."""
    from dsexp.models.presets import code_digest, folder_digest

    try:
        if "folder" in source:
            content = folder_digest(source["folder"])
        else:
            content = code_digest(source.get("arch"), source.get("config_path"))
    except OSError:
        return None
    digest = hashlib.sha1(f"{key}|{dtype}|{content}".encode()).hexdigest()[:16]
    root = Path(os.environ.get("DSEXP_CACHE") or Path.home() / ".cache" / "dsexp").expanduser()
    return root / "buffers" / f"{digest}.json"


@functools.lru_cache(maxsize=16)
def _duplicates(source_json: str, dtype: str):
    import torch

    model = arch.model_with_buffers(json.loads(source_json), dtype)
    found = tuple(sorted(duplicate_buffers(model, torch.equal).items()))
    del model
    return found


def share(placements: List[Placement], shared: Dict[str, str], tp: int, notes: List[str]) -> List[Placement]:
    """The placements with each shared buffer holding no bytes of its own on any rank."""
    notes.append(f"trim.dedupe_buffers: {len(shared)} buffers share an identical one (no bytes of their own)")
    return [_shared(p, shared[p.name], tp) if p.is_buffer and p.name in shared else p for p in placements]


def _shared(p: Placement, first: str, tp: int) -> Placement:
    return Placement(p.name, p.full, (0,) * tp, f"shared with {first}", is_buffer=True)
