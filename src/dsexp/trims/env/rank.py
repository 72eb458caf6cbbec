"""trim.env on a rank: what its environment holds for the trim.env keys (proof they reached it)."""

from __future__ import annotations

import os
from typing import Dict, Iterable, Optional


def env_seen(keys: Iterable[str]) -> Dict[str, Optional[str]]:
    return {k: os.environ.get(k) for k in sorted(keys)}
