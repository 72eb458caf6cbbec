"""Several budget searches of one budget read as one: a space searched in parts (one sweep a tp, a load strategy
added later, a step cut by a time limit) answered over its whole union.

Each search's configurations are keyed again by every dimension any of them varied (a search that fixed `load=meta`
in its overrides gets `load=meta` in its key), its points name their job as `<search folder>/<job>`, and the full
grid counts the product of the dimensions' values seen, so the combinations no search covered are named, not
silently dropped. Searches of different budgets (GPUs, GiB, host, prompt, new tokens, batch range) are not one
question: merging them is refused with the first difference.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, Dict, List, Sequence, Tuple

from dsexp.analysis.budget_runs import job_name, read_search
from dsexp.analysis.sources import results_from_dir

SAME = ("budget", "device", "prompt_tokens", "new_tokens", "batches", "run_bound")  # what one question shares


class MergeError(ValueError):
    pass


def read_merged(dirs: Sequence[Path]) -> Tuple[Dict[str, Any], List[Dict[str, Any]]]:
    """The merged search of these sweep folders and their results, each result tagged with its folder's name."""
    named, results = [], []
    for d in dirs:
        s = read_search(d)
        if s is None:
            raise MergeError(f"{d} holds no budget search (no budget.json)")
        named.append((Path(d).name, s))
        results += [{**r, "sweep": Path(d).name} for r in results_from_dir(d)]
    return merge(named), results


def merge(named: Sequence[Tuple[str, Dict[str, Any]]]) -> Dict[str, Any]:
    """One search state (as dsexp.compose.budget writes budget.json) over these named searches' union."""
    _check_one_question(named)
    first = named[0][1]
    dims = sorted(dict.fromkeys(d for _, s in named for d in s.get("dims") or []), key=_dim_order)
    configs = [_rekeyed(c, dims, name) for name, s in named for c in s.get("configs") or []]
    seen = _values_seen(configs, dims)
    grid = [dict(zip(dims, vals)) for vals in itertools.product(*(seen[d] for d in dims))]
    keys = {c["key"] for c in configs}
    out = {k: first.get(k) for k in SAME}
    out.update(
        dims=dims,
        configs=configs,
        runs=sum(s.get("runs") or 0 for _, s in named),
        jobs=[{**j, "dir": f"{name}/{job_name(j.get('dir'))}"} for name, s in named for j in s.get("jobs") or []],
        grid_configs=len(grid),
        full_grid_runs=len(grid) * len(first.get("batches") or []),
        one_batch_per_job=any(s.get("one_batch_per_job") for _, s in named),
        merged_from=[n for n, _ in named],
        not_searched=[k for k in (_key(g, dims) for g in grid) if k not in keys],
    )
    return out


def _check_one_question(named: Sequence[Tuple[str, Dict[str, Any]]]) -> None:
    labels = [n for n, _ in named]
    if len(set(labels)) != len(labels):
        raise MergeError(f"two searches share a folder name ({', '.join(labels)}): their jobs could not be told apart")
    first_name, first = named[0]
    for name, s in named[1:]:
        diff = next((d for d in (_difference(k, s.get(k), first.get(k)) for k in SAME) if d), "")
        if diff:
            raise MergeError(f"{name} and {first_name} asked different questions: {diff}")


def _difference(name: str, a: Any, b: Any) -> str:
    """'' where the two agree, else the first field that differs (a budget: its own field, e.g. budget.gpu_gib)."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted({**b, **a}, key=lambda k: (k not in ("gpus", "gpu_gib", "host_gib"), k))  # the user's first
        return next((_difference(f"{name}.{k}", a.get(k), b.get(k)) for k in keys if a.get(k) != b.get(k)), "")
    if name == "batches" and a != b:
        return f"batches {a[0]}..{a[-1]} vs {b[0]}..{b[-1]}" if a and b else f"batches {a} vs {b}"
    return "" if a == b else f"{name} {a} vs {b}"


def _dim_order(d: str) -> int:
    """tp first, then how the model is loaded, the engine, ZeRO, the trims; the rest as they came (a stable sort)."""
    order = ("tp", "load", "engine", "zero", "trim")
    return order.index(d) if d in order else len(order)


def _rekeyed(c: Dict[str, Any], dims: List[str], label: str) -> Dict[str, Any]:
    values = _dim_values(c, dims)
    points = [{**p, "job": f"{label}/{job_name(p.get('job'))}"} if p.get("job") else p for p in c.get("points") or []]
    return {**c, "key": _key(values, dims), "dims": values, "points": points, "search": label}


def _dim_values(c: Dict[str, Any], dims: List[str]) -> Dict[str, str]:
    """Each dimension's value for this configuration: its own, else what its overrides fixed (tp: its tp)."""
    fixed = dict(o.split("=", 1) for o in c.get("overrides") or [] if "=" in o and not o.startswith(("+", "~")))
    own = c.get("dims") or {}
    return {d: str(own.get(d, fixed.get(d, c.get("tp") if d == "tp" else "?"))) for d in dims}


def _values_seen(configs: List[Dict[str, Any]], dims: List[str]) -> Dict[str, List[str]]:
    return {d: list(dict.fromkeys(c["dims"][d] for c in configs)) for d in dims}


def _key(values: Dict[str, str], dims: List[str]) -> str:
    return " ".join(f"{d}={values[d]}" for d in dims)
