"""The workload's shape: the grid of (batch, prompt tokens) points one job runs, each point its own phase.

`generate.batch_size` and `generate.prompt_tokens` are each an int or a list; a list makes a grid run inside one
job (the model loads once). Points run in ascending (prompt tokens, batch) order, so a point that runs out of memory
is met before the larger ones it makes pointless (`dominated`). A grid of one point keeps the phase name
`generate`; a larger grid names each point's phase `generate[b=8,l=2048]`.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from typing import Any, Iterable, List, Optional

GENERATE = "generate"
BATCH_KEY = "generate.batch_size"  # the override a budget search sets per job, and its answer's command
BISECT_KEY = "generate.bisect_from"  # where a job's batch search inside its one load starts (dsexp.core.bisect)
# The correctness check's logits call (a job's first point) runs the first sequence alone: every sequence of a point
# is the same prompt, and at the point's batch that call raised the point's reserved peak above the others' (an
# H100 at 4 x 19 GiB ran batch 7 without it where the replay with it said 4: docs/FINDINGS.md 6e)
CHECK_BATCH = 1
NOT_MEASURED = ("skipped", "not_run")
# How dsexp's ranks call generate (greedy, exactly the new tokens: `min_new_tokens` too), and so how the memory model
# traces it on the meta device (dsexp.predict.meta_trace)
GREEDY = {
    "do_sample": False,
    "return_dict_in_generate": True,
    "pad_token_id": 0,
}  # a point's statuses where nothing ran: larger than one that ran out; no launch
_POINT_KEY = re.compile(r"^(?P<kind>\w+)\[b=(?P<b>\d+),l=(?P<l>\d+|text)\]$")


@dataclass(frozen=True)
class Point:
    """One workload point: `batch` sequences of `prompt_tokens` tokens (None: the prompt text as tokenized)."""

    batch: int
    prompt_tokens: Optional[int]

    @property
    def tokens(self) -> int:
        """Tokens of the prefill (batch x prompt length); the prompt text counts 0 (its length is the tokenizer's)."""
        return self.batch * (self.prompt_tokens or 0)

    def phase(self, single: bool) -> str:
        return GENERATE if single else f"{GENERATE}[b={self.batch},l={self.prompt_tokens or 'text'}]"

    def to_dict(self) -> dict:
        return {"batch": self.batch, "prompt_tokens": self.prompt_tokens}


def as_list(value: Any) -> List[Any]:
    """An int, None or a list (OmegaConf's ListConfig included) as a list."""
    if isinstance(value, (list, tuple)) or type(value).__name__ == "ListConfig":
        return list(value)
    return [value]


def grid(generate: Any) -> List[Point]:
    """The points of a GenerateConfig (or its dict), in the order they run, duplicates dropped."""
    get = generate.get if isinstance(generate, dict) else lambda k, d=None: getattr(generate, k, d)
    batches = sorted({int(b) for b in as_list(get("batch_size", 1))})
    lengths = as_list(get("prompt_tokens"))
    lengths = [None] if lengths == [None] else sorted({int(n) for n in lengths})
    return [Point(b, n) for n, b in itertools.product(lengths, batches)]


def dominated(point: Point, out_of_memory: Iterable[Point]) -> Optional[Point]:
    """The point that ran out of memory which `point` is at least as large as in batch and length, if any."""
    for oom in out_of_memory:
        if point.batch >= oom.batch and (point.prompt_tokens or 0) >= (oom.prompt_tokens or 0):
            return oom
    return None


def parse_phase(key: str) -> Optional[Point]:
    """`generate[b=8,l=2048]` -> Point(8, 2048); None for any other phase key."""
    m = _POINT_KEY.match(key)
    if not m:
        return None
    return Point(int(m["b"]), None if m["l"] == "text" else int(m["l"]))


def metric_name(key: str) -> str:
    """A phase key as MLflow accepts it in a metric name: `generate[b=8,l=2048]` -> `generate_b8_l2048`."""
    m = _POINT_KEY.match(key)
    return f"{m['kind']}_b{m['b']}_l{m['l']}" if m else key


def percentile(values: List[float], q: float) -> Optional[float]:
    """The q-th percentile (0-100) with linear interpolation between order statistics (numpy's default)."""
    if not values:
        return None
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(values: List[float]) -> dict:
    """mean, p50, p90, p99, min, max and n of a list of seconds."""
    if not values:
        return {"n": 0}
    return {
        "n": len(values),
        "mean": sum(values) / len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "min": min(values),
        "max": max(values),
    }
