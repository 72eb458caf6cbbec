"""Small file helpers every stage uses: atomic JSON writes, tolerant reads, and build-once cached folders."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, Optional, Tuple


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive lock on `path` (created if missing), held for the block: flock, so it dies with its process."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def build_once(final: Path, mark: str, build: Callable[[Path], Dict[str, Any]]) -> Tuple[Dict[str, Any], bool]:
    """A cached folder (checkpoint, per-rank split), built at most once across concurrent jobs: under a lock beside
    `final`, `build(tmp)` creates and fills a fresh sibling folder and returns its record, which is written inside as
    `mark`; then the folder is renamed into place. Returns (record, cache hit); a hit reads the record back."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with file_lock(Path(str(final) + ".lock")):
        if (final / mark).is_file():
            return json.loads((final / mark).read_text()), True
        tmp = final.with_name(final.name + f".tmp{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            done = build(tmp)
        except BaseException:  # a half-written folder would hold the disk (a failed 20B checkpoint: 20 GiB)
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        (tmp / mark).write_text(json.dumps(done))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        return done, False


def write_json_atomic(path: Path, data: Any, fsync: bool = True) -> None:
    """Write via a temp file in the same folder + rename, so readers never see a torn file.

    fsync=False for files rewritten often whose loss in a machine crash does not matter (live files)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=str)
            f.flush()
            if fsync:
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Replace a file's text at once (temp file + rename, no fsync): a reader sees the old text or the new."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_json(path: Path) -> Optional[dict]:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
