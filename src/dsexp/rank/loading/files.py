"""Checkpoint files: which ones a folder holds, their tensor names, and a strict, streaming fill of a model.

Tensors are read one at a time, so a fill holds at most one source tensor beyond the model itself.
safetensors' `get_tensor` is a view of the file's mmap, and every page touched stays mapped (counted
in the rank's RSS as file-backed) until the handle *and* all its tensors are gone: the file is
therefore reopened for each tensor. `.bin` files are loaded with `mmap=True` (their mapping lives until
the last tensor of the file is copied).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

_INDEX = {"safetensors": "model.safetensors.index.json", "bin": "pytorch_model.bin.index.json"}
_GLOB = {"safetensors": "*.safetensors", "bin": "pytorch_model*.bin"}


def checkpoint_files(model_dir: Path, fmt: str) -> List[Path]:
    """Absolute paths of the weight files of this format (from the index when there is one)."""
    model_dir = Path(model_dir).resolve()
    index = model_dir / _INDEX[fmt]
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / n for n in names]
    else:
        files = sorted(model_dir.glob(_GLOB[fmt]))
    if not files:
        raise FileNotFoundError(f"{model_dir} holds no {fmt} weight files")
    return files


def read_tensors(path: Path) -> Iterator[Tuple[str, Any]]:
    """(name, tensor) pairs of one file, each on the CPU, read lazily."""
    if str(path).endswith(".safetensors"):
        from safetensors import safe_open

        for name in tensor_names(path):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                tensor = f.get_tensor(name)
            yield name, tensor
            del tensor
    else:
        import torch

        sd = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        while sd:
            yield sd.popitem()


def tensor_names(path: Path) -> List[str]:
    """Names in one file without reading its data."""
    if str(path).endswith(".safetensors"):
        from safetensors import safe_open

        with safe_open(str(path), framework="pt", device="cpu") as f:
            return list(f.keys())
    import torch

    return list(torch.load(path, map_location="cpu", mmap=True, weights_only=True))


def fill(module, files: List[Path], tied: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Copy every tensor of `files` into the module's allocated parameters and persistent buffers.

    Strict: a name the module lacks, a shape that differs, or a module tensor no file provides is an
    error, so nothing is silently left uninitialised. Tied tensors (one object under several names)
    count as filled once any of their names is. `tied` ({alias: name}): tensors the files' model shared;
    where the module holds them apart (`to_empty` unties), the alias is made the named tensor again
    (`retied`). `copy_` converts dtype and moves to the tensor's device.
    """
    import torch

    targets = {k: v for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, torch.Tensor)}
    retied = _retie(module, targets, tied or {})
    meta = [k for k, v in targets.items() if v.is_meta]
    if meta:
        raise RuntimeError(f"cannot fill tensors still on the meta device: {', '.join(meta[:8])}")
    filled_ids, unexpected, nbytes, count = set(), [], 0, 0
    for path in files:
        for name, src in read_tensors(path):
            dst = targets.get(name)
            if dst is None:
                unexpected.append(name)
                continue
            if tuple(dst.shape) != tuple(src.shape):
                raise RuntimeError(
                    f"{name}: {path.name} holds shape {tuple(src.shape)}, the module expects {tuple(dst.shape)}"
                )
            with torch.no_grad():
                dst.copy_(src)
            filled_ids.add(id(dst))
            nbytes += src.numel() * src.element_size()
            count += 1
            del src
    missing = [k for k, v in targets.items() if id(v) not in filled_ids]
    if unexpected or missing:
        raise RuntimeError(
            f"strict fill failed: {len(missing)} module tensors not in the files "
            f"({', '.join(missing[:8])}); {len(unexpected)} file tensors not in the module "
            f"({', '.join(unexpected[:8])})"
        )
    return {"tensors": count, "bytes_read": nbytes, "files": [str(p) for p in files], "retied": retied}


def _retie(module, targets: Dict[str, Any], tied: Dict[str, str]) -> List[str]:
    """Make each alias in `tied` the same tensor as its name again where the module holds two; return them."""
    from dsexp.core.module_buffers import owner_of

    done = []
    for alias, name in tied.items():
        if alias in targets and name in targets and targets[alias] is not targets[name]:
            owner, leaf = owner_of(module, alias)
            slot = owner._parameters if leaf in owner._parameters else owner._buffers
            slot[leaf] = targets[alias] = targets[name]
            done.append(alias)
    return done
