"""How long `python -m dsexp.plan` takes on this machine, after its imports: one 20B configuration, and a space of 18.

    make benchmark NAME=plan          (or: .venv/bin/python benchmarks/plan.py)

One configuration: InternLM2 at 20B shapes (remote code, built on the meta device from its config), tp=2, AutoTP
trimmed, on an 80 GiB card with two prompt lengths, after the imports (a plan of InternLM2's tiny preset first, which
imports the same modules): the first plan of it (the model built on the meta device) and the next ones (built once
per process). trim.dedupe_buffers compares the model's real RoPE tables once per machine (kept in the cache folder):
the benchmark runs in a fresh cache folder and reports that first comparison apart. The space: tp=1,2,4 x
load=eager,meta,sharded x trim=none,all at the same shapes. And with `--replay` (the caching allocator's replay of
each point's generate, the budget search's first guess): the 2 x 40 GiB space the H200 searched (tp=1,2 x
load=meta,eager x trim=none,all, AutoTP, 2048-token prompts and 8 new tokens), the time a budget search spends
before it launches anything. Writes results/<machine>/plan_bench.{json,md}.
Targets (issue "Ask before you run"): one configuration under 2 s, the space under 10 s, on the 2-core CPU machine.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = ["model=internlm2_20b_shapes", "gpu=h100_80gb", "generate.prompt_tokens=[512,2048]"]
ONE = MODEL + ["tp=2", "load=meta", "trim=all"]
SPACE = MODEL + ["tp=1,2,4", "load=eager,meta,sharded", "trim=none,all"]
# campaign budget's step gpu40 (and gpu40_one_load): what its search replays before the first job
REPLAYED = ["model=internlm2_20b_shapes", "experiment=autotp", "engine.injection_policy=infer", "launcher.gpus=1",
            "generate.prompt_tokens=2048", "generate.new_tokens=8", "budget.gpus=2", "budget.gpu_gib=40", "tp=1,2",
            "load=meta,eager", "trim=none,all"]  # fmt: skip


def timed(overrides, multirun: bool, replay: bool = False):
    from dsexp.compose.planning import plan_one, space

    t0 = time.perf_counter()
    planned = space(overrides, multirun)
    composed = time.perf_counter()
    entries = [plan_one(p, replay) for p in planned]
    return entries, composed - t0, time.perf_counter() - composed


def replayed_batches(entries) -> list:
    """Per configuration: its label and the replay's largest batch, default and with expandable segments."""
    out = []
    for e in entries:
        fit = ((e.get("largest_batch") or {}).get("2048") or {}).get("replayed") or {}
        batches = [(fit.get(k) or {}).get("batch") for k in ("default", "expandable_segments")]
        out.append({"configuration": e["configuration"], "default": batches[0], "expandable_segments": batches[1]})
    return out


def machine() -> str:
    return "cpu" if not Path("/proc/driver/nvidia").exists() else platform.node()


def main() -> int:
    os.environ["DSEXP_CACHE"] = tempfile.mkdtemp(prefix="dsexp-plan-bench-")  # no comparison kept from before
    t0 = time.perf_counter()
    timed(["model=internlm2_tiny", "tp=2", "trim=all"], False)  # the imports (torch, transformers, DeepSpeed, Hydra)
    imports = time.perf_counter() - t0
    _, c, p = timed(ONE, False)  # the first on this machine: RoPE tables compared for trim.dedupe_buffers, kept
    first_ever = c + p
    from dsexp.predict import architecture
    from dsexp.trims.dedupe_buffers import placement as dedupe

    architecture._build.cache_clear()  # as a new process finds it: the meta model not built, the comparison on disk
    dedupe._duplicates.cache_clear()
    runs = [timed(ONE, False) for _ in range(3)]
    first, again = runs[0], runs[1:]
    space_entries, space_compose, space_predict = timed(SPACE, True)
    replay_entries, replay_compose, replay_predict = timed(REPLAYED, True, replay=True)
    shutil.rmtree(os.environ["DSEXP_CACHE"], ignore_errors=True)
    statuses = sorted({e["status"] for e in space_entries})
    out = {
        "imports_s": round(imports, 2),
        "one_configuration": {
            "overrides": ONE,
            "first_on_the_machine_s": round(first_ever, 2),
            "first_s": round(first[1] + first[2], 2),
            "again_s": [round(c + p, 2) for _, c, p in again],
            "largest_batch": first[0][0].get("largest_batch"),
        },
        "space": {
            "overrides": SPACE,
            "configurations": len(space_entries),
            "statuses": statuses,
            "compose_s": round(space_compose, 2),
            "predict_s": round(space_predict, 2),
            "total_s": round(space_compose + space_predict, 2),
        },
        "replayed_space": {
            "overrides": REPLAYED,
            "configurations": len(replay_entries),
            "total_s": round(replay_compose + replay_predict, 2),
            "largest_batch": replayed_batches(replay_entries),
        },
        "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0]},
    }
    folder = ROOT / "results" / machine()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan_bench.json").write_text(json.dumps(out, indent=1) + "\n")
    (folder / "plan_bench.md").write_text(markdown(out) + "\n")
    print(markdown(out))
    return 0


def markdown(out) -> str:
    one, sp, rp = out["one_configuration"], out["space"], out["replayed_space"]
    replayed = "; ".join(
        f"{r['configuration']}: {r['default']} / {r['expandable_segments']}"
        for r in rp["largest_batch"]
        if r["default"] is not None
    )
    return "\n".join(
        [
            "# dsexp.plan: time after imports",
            "",
            f"Imports (torch, transformers, DeepSpeed, Hydra; a tiny InternLM2 planned): {out['imports_s']} s, once "
            "per process; "
            f"{out['machine']['cores']} cores, Python {out['machine']['python']}.",
            "",
            "| what | seconds | target |",
            "|---|---:|---:|",
            f"| one 20B configuration (`{' '.join(one['overrides'])}`), the first on this machine (RoPE tables "
            f"compared once for trim.dedupe_buffers, then kept) | {one['first_on_the_machine_s']} | |",
            f"| the same, first in a process (model built on the meta device) | {one['first_s']} | < 2 |",
            f"| the same again (model built once per process) | {', '.join(map(str, one['again_s']))} | < 2 |",
            f"| {sp['configurations']} configurations (tp x load x trim): compose + check | {sp['compose_s']} | |",
            f"| {sp['configurations']} configurations: predict | {sp['predict_s']} | |",
            f"| {sp['configurations']} configurations: total | {sp['total_s']} | < 10 |",
            f"| with `--replay`: the {rp['configurations']} configurations of the 2 x 40 GiB budget search "
            f"(`{' '.join(rp['overrides'])}`) | {rp['total_s']} | |",
            "",
            f"Replayed largest batch at 2048 tokens, default / expandable segments: {replayed or 'none'}.",
            "",
            f"Statuses over the space: {', '.join(sp['statuses'])}. Largest batch (one configuration, 80 GiB): "
            + "; ".join(f"L={n}: {c['largest_batch']}" for n, c in (one["largest_batch"] or {}).items()),
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
