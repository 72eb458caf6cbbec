"""Checkpoint folders as files: their config.json, and a cheap integrity check that reads no tensor data."""

from __future__ import annotations

import json
import struct
import zipfile
from pathlib import Path
from typing import Any, Dict, Optional


def folder_config(folder: Path) -> Dict[str, Any]:
    """The folder's config.json as a dict."""
    with open(Path(folder).expanduser() / "config.json") as f:
        return json.load(f)


def checkpoint_problem(folder: Path) -> Optional[str]:
    """Cheap integrity check of a checkpoint folder (headers and sizes only, no tensor data is read): shards the
    index names but that are missing, safetensors files whose header is unreadable or whose size disagrees with
    it (truncated), and zip-format .bin files with no zip directory. None if nothing is wrong."""
    folder = Path(folder)
    for index in folder.glob("*.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, AttributeError) as e:
            return f"{index.name} is unreadable ({type(e).__name__}: {e})"
        missing = sorted(f for f in shards if not (folder / f).is_file())
        if missing:
            return f"{index.name} names shards that are missing: {', '.join(missing)}"
    for path in sorted(folder.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path.name} {problem}"
    for path in sorted(folder.glob("*.bin")):
        with open(path, "rb") as f:
            zipped = f.read(2) == b"PK"
        if zipped and not zipfile.is_zipfile(path):
            return f"{path.name} is truncated or corrupt (a zip-format torch checkpoint without its zip directory)"
    return None


def _safetensors_problem(path: Path) -> Optional[str]:
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return f"is truncated or empty ({size} bytes, no safetensors header)"
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            return f"is truncated or corrupt (header length {n} > file size {size})"
        try:
            header = json.loads(f.read(n))
            end = max([v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"] + [0])
        except (ValueError, KeyError, TypeError, IndexError) as e:
            return f"has a corrupt safetensors header ({type(e).__name__})"
    if 8 + n + end != size:
        return (
            f"is truncated ({size} bytes, its header describes {8 + n + end})"
            if size < 8 + n + end
            else f"is corrupt ({size} bytes, its header describes {8 + n + end})"
        )
    return None
