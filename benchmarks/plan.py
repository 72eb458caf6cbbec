"""How long `python -m dsexp.plan` takes on this machine, the allocator replay included (the plan's default), with
where the time goes: the generate's traces on the meta device, the allocator's replays, DeepSpeed's init on the meta
device, the rest (composing, the memory model's formulas), and the imports apart.

    make benchmark NAME=plan          (or: .venv/bin/python benchmarks/plan.py)

The cases (issue 62): one 20B configuration replayed (`model=llama_20b_shapes tp=1`, 60 GiB, 2048 and 4096-token
prompts + 16 new tokens); Llama-3.1-70B from its published config.json (examples/llama-3.1-70b) at tp=2, 4 and 8 on
an 80 GiB card, each configuration timed; the space of 18 configurations (InternLM2 at 20B shapes, tp=1,2,4 x
load=eager,meta,sharded x trim=none,all, 512 and 2048-token prompts, an 80 GiB card); the 2 x 40 GiB space the H200's
budget search replays before its first job. Each case runs in this one process after the imports, in the order
listed: a trace or an init verdict an earlier case made is not made again (as in a plan of several configurations).
Wall seconds and CPU seconds (user + system of this process) side by side: on a machine whose cores are shared, the
wall time counts the others' work too. Writes results/<machine>/plan_bench.{json,md}.
Targets (issue 62): one configuration's replayed answer within 3 s, the 18 configurations within 30 s, on the
2-core CPU machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
L70B = str(ROOT / "examples" / "llama-3.1-70b")
CASES = {
    "20b_tp1_2048": ["model=llama_20b_shapes", "tp=1", "generate.prompt_tokens=2048", "generate.new_tokens=16",
                     "budget.gpu_gib=60"],
    "20b_tp1_4096": ["model=llama_20b_shapes", "tp=1", "generate.prompt_tokens=4096", "generate.new_tokens=16",
                     "budget.gpu_gib=60"],
    "70b_tp2_4_8": ["model=config", f"model.config_path={L70B}", "gpu=h100_80gb", "generate.prompt_tokens=2048",
                    "generate.new_tokens=16", "tp=2,4,8"],
    "space_18": ["model=internlm2_20b_shapes", "gpu=h100_80gb", "generate.prompt_tokens=[512,2048]", "tp=1,2,4",
                 "load=eager,meta,sharded", "trim=none,all"],
    # campaign budget's step gpu40 (and gpu40_one_load): what its search replays before the first job
    "gpu40_space_8": ["model=internlm2_20b_shapes", "experiment=autotp", "engine.injection_policy=infer",
                      "launcher.gpus=1", "generate.prompt_tokens=2048", "generate.new_tokens=8", "budget.gpus=2",
                      "budget.gpu_gib=40", "tp=1,2", "load=meta,eager", "trim=none,all"],
}  # fmt: skip
PARTS = ("trace", "replay", "init")


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Clock:
    """Wall and CPU seconds spent inside the functions of each part (PARTS), summed over the calls."""

    def __init__(self):
        self.wall = dict.fromkeys(PARTS, 0.0)
        self.cpu = dict.fromkeys(PARTS, 0.0)
        self.depth = dict.fromkeys(PARTS, 0)

    def wrap(self, owner, name: str, part: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            self.depth[part] += 1
            w, c = time.perf_counter(), cpu()
            try:
                return original(*args, **kwargs)
            finally:
                self.depth[part] -= 1
                if not self.depth[part]:  # the outermost call counts (a part may call itself)
                    self.wall[part] += time.perf_counter() - w
                    self.cpu[part] += cpu() - c

        setattr(owner, name, timed)

    def reset(self) -> None:
        self.wall, self.cpu = dict.fromkeys(PARTS, 0.0), dict.fromkeys(PARTS, 0.0)


def instrument() -> Clock:
    """Times the parts where the plan's own functions make them (wrapped where their callers look them up)."""
    from dsexp.engines.init_inference import placement
    from dsexp.predict import allocator, fragmentation

    clock = Clock()
    clock.wrap(fragmentation, "generate_events", "trace")
    clock.wrap(allocator.Allocator, "run", "replay")
    clock.wrap(placement, "_first_failing_rank", "init")
    return clock


def run_case(overrides, clock: Clock) -> dict:
    from dsexp.compose.planning import plan_one, space

    clock.reset()
    w0, c0 = time.perf_counter(), cpu()
    planned = space(overrides, multirun=True)
    entries = []
    for p in planned:
        w, c = time.perf_counter(), cpu()
        entry = plan_one(p, replay=True)
        entries.append({**summary(entry), "wall_s": round(time.perf_counter() - w, 2), "cpu_s": round(cpu() - c, 2)})
    wall, used = time.perf_counter() - w0, cpu() - c0
    parts = {k: {"wall_s": round(clock.wall[k], 2), "cpu_s": round(clock.cpu[k], 2)} for k in PARTS}
    parts["other"] = {
        "wall_s": round(wall - sum(clock.wall.values()), 2),
        "cpu_s": round(used - sum(clock.cpu.values()), 2),
    }
    return {"overrides": overrides, "wall_s": round(wall, 2), "cpu_s": round(used, 2), "parts": parts,
            "configurations": entries}  # fmt: skip


def summary(entry: dict) -> dict:
    """A configuration's label, status and, per prompt length, the bound's and the replay's largest batches."""
    out = {"configuration": entry["configuration"], "status": entry["status"]}
    for n, fit in (entry.get("largest_batch") or {}).items():
        replayed = fit.get("replayed") or {}
        out[f"L{n}"] = {
            "bound": fit.get("allocated_bytes_bound", fit.get("largest_batch")),  # before issue 62: largest_batch
            "default": (replayed.get("default") or {}).get("batch"),
            "expandable_segments": (replayed.get("expandable_segments") or {}).get("batch"),
        }
    return out


def machine() -> str:
    return "cpu" if not Path("/proc/driver/nvidia").exists() else platform.node()


def main() -> int:
    os.environ["DSEXP_CACHE"] = tempfile.mkdtemp(prefix="dsexp-plan-bench-")  # no comparison kept from before
    w, c = time.perf_counter(), cpu()
    from dsexp.compose.planning import plan_one, space

    for p in space(["model=internlm2_tiny", "tp=2", "trim=all"], False):  # imports torch, transformers, DeepSpeed
        plan_one(p)
    imports = {"wall_s": round(time.perf_counter() - w, 2), "cpu_s": round(cpu() - c, 2)}
    clock = instrument()
    cases = {name: run_case(overrides, clock) for name, overrides in CASES.items()}
    shutil.rmtree(os.environ["DSEXP_CACHE"], ignore_errors=True)
    out = {"imports": imports, "cases": cases, "machine": {"cores": os.cpu_count(), "python": sys.version.split()[0]}}
    with contextlib.suppress(Exception):
        from dsexp.core.compat import installed

        out["machine"]["versions"] = {p: installed(p) for p in ("torch", "transformers", "deepspeed")}
    folder = ROOT / "results" / machine()
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan_bench.json").write_text(json.dumps(out, indent=1) + "\n")
    (folder / "plan_bench.md").write_text(markdown(out) + "\n")
    print(markdown(out))
    return 0


def seconds(t: dict) -> str:
    return f"{t['wall_s']} / {t['cpu_s']}"


def markdown(out: dict) -> str:
    m = out["machine"]
    lines = [
        "# dsexp.plan: time with the allocator replay (wall / CPU seconds)",
        "",
        f"{m['cores']} cores (shared: wall counts others' work, CPU is this process's user + system), Python "
        f"{m['python']}, {', '.join(f'{k} {v}' for k, v in (m.get('versions') or {}).items())}. Imports (torch, "
        f"transformers, DeepSpeed, Hydra; a tiny InternLM2 planned): {seconds(out['imports'])}, once per process.",
        "",
        "| case | configurations | total | trace | replay | init | other |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for name, case in out["cases"].items():
        parts = case["parts"]
        lines.append(
            f"| {name} | {len(case['configurations'])} | {seconds(case)} | "
            + " | ".join(seconds(parts[k]) for k in (*PARTS, "other"))
            + " |"
        )
    lines += ["", "Per configuration (wall / CPU seconds; largest batch: the bound / replayed default / "
              "replayed expandable segments):", ""]  # fmt: skip
    for name, case in out["cases"].items():
        for e in case["configurations"]:
            fits = "; ".join(
                f"{k}: {v['bound']} / {v['default']} / {v['expandable_segments']}"
                for k, v in e.items()
                if k.startswith("L")
            )
            lines.append(f"- {name} `{e['configuration']}`: {e['wall_s']} / {e['cpu_s']} s, {e['status']}; {fits}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
