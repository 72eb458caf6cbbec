"""What the benchmarks of `make bench` share: running dsexp jobs, the machine's name, and results/<machine>/bench.json
and bench.md, which hold one section per benchmark.

Each benchmark is one file (SECTIONS names them) with SECTION (its key in bench.json), `add_arguments` (its
options), `run(args, work)` (the measurement: a dict, kept as bench.json[SECTION]) and `render(data)` (its part of
bench.md, from the whole of bench.json); `python benchmarks/<file>.py` runs it alone, `benchmarks/run.py` runs them
all in one work folder. bench.json and bench.md are rewritten after every section: a run cut short keeps what it
measured, and a run of some sections keeps the others. Not tests: timings on a shared machine are noisy, so nothing
is asserted; each figure is set against its target and a gap is stated as such.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Dict, List, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from dsexp.analysis.sources import results_from_dir  # noqa: E402

# section (its key in bench.json) -> the benchmark's file in benchmarks/, in the order `make bench` runs them
SECTIONS = {
    "imports": "rank_startup",
    "writer": "checkpoint_writer",
    "overhead": "job_overhead",
    "sampler": "sampler_on_off",
    "series": "memory_series",
    "stacks": "stack_build",
}
REPORT_ORDER = ("overhead", "sampler", "series", "writer", "stacks", "imports")  # bench.md's sections
SCHEMA = 3  # bench.json of another schema is not merged into
SAMPLER_CORE_PCT = 1.0  # target: the peak sampler's thread, % of one core (judged on jobs in sampler_on_off.py)

Run = Callable[[argparse.Namespace, Path], Dict[str, Any]]


def machine_name() -> str:
    try:
        import pynvml

        pynvml.nvmlInit()
        n = pynvml.nvmlDeviceGetCount()
        name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0)) if n else ""
    except Exception:
        return "cpu"
    name = name.decode() if isinstance(name, bytes) else name
    model = re.search(r"\b([A-Z]\d{2,3}[A-Z]*)\b", name or "")
    if not n:
        return "cpu"
    return (model.group(1) if model else "gpu").lower() + (f"x{n}" if n > 1 else "")


def gpu_count() -> int:
    from dsexp.job.devices import visible_gpus

    return visible_gpus()


def dsexp(args: List[str], workdir: Path, log: Path) -> None:
    """`python -m dsexp ARGS` in workdir with the benchmark's own cache (workdir/cache, empty at first); output
    to log; raise with its tail on failure."""
    with open(log, "w") as f:
        proc = subprocess.run(
            [sys.executable, "-m", "dsexp", *args, f"cache_dir={workdir / 'cache'}"],
            cwd=workdir,
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    if proc.returncode:
        raise RuntimeError(f"dsexp {' '.join(args)} failed ({proc.returncode}):\n{log.read_text()[-3000:]}")


def results(sweep: Path) -> List[Dict[str, Any]]:
    """The sweep's results in job order; a benchmark only counts when every job worked."""
    out = results_from_dir(sweep)
    bad = [r["job_dir"] for r in out if r["status"] != "ok"]
    if bad:
        raise RuntimeError(f"jobs failed: {bad}")
    return out


def compose(model: str) -> Dict[str, Any]:
    """The job config `python -m dsexp model=<model>` runs (dsexp's own composition: its schema registered)."""
    from omegaconf import OmegaConf

    from dsexp.compose.config import compose_app, without_hydra

    return OmegaConf.to_container(without_hydra(compose_app([f"model={model}"])), resolve=True)


def summary(values: List[float]) -> Dict[str, float]:
    return {"mean": statistics.mean(values), "min": min(values), "max": max(values)} if values else {}


def _row(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def table(head: List[str], rows: List[List[Any]]) -> List[str]:
    return [_row(head), _row(["---"] * len(head)), *map(_row, rows), ""]


def met(value: float, limit: float, unit: str) -> str:
    """A figure with an upper limit: "met", or "NOT met" and by how much."""
    return "met" if value <= limit else f"NOT met (gap {value - limit:.2f} {unit})"


# --- bench.json and bench.md ----------------------------------------------------------------------


def parser(doc: str) -> argparse.ArgumentParser:
    """The options every benchmark of bench.json takes (its own are added by its `add_arguments`)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--machine", help="results/<machine>/ (default: cpu, or e.g. h200x2 from NVML)")
    ap.add_argument("--out", type=Path, default=ROOT / "results", help="results root")
    ap.add_argument("--keep", type=Path, help="copy the benchmark's sweep folders and logs here")
    return ap


def render(data: Dict[str, Any]) -> str:
    """bench.md: a header, then each section measured, rendered by its own benchmark."""
    out = [
        f"# dsexp's own speed on `{data['machine']}`",
        "",
        f"{data['time']} · {data['host']['cpus']} CPUs · {data['host']['mem_gib']:.0f} GiB · "
        f"Python {data['host']['python']} · generated by `make bench` (benchmarks/run.py); numbers from one "
        "run on a possibly shared machine, so expect noise of several percent.",
        "",
    ]
    for name in REPORT_ORDER:
        if data.get(name):
            out += importlib.import_module(SECTIONS[name]).render(data)
    return "\n".join(out)


def run_sections(sections: Sequence[Tuple[str, Run]], args: argparse.Namespace) -> int:
    """Run (name, run) in turn in one temporary work folder (the jobs' cache and MLflow store, empty at first;
    `args.done` lists the sections already run in it), each kept in results/<machine>/bench.json and bench.md as
    soon as it is measured."""
    import psutil

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)
    machine = args.machine or machine_name()
    folder = args.out / machine
    folder.mkdir(parents=True, exist_ok=True)
    data = json.loads((folder / "bench.json").read_text()) if (folder / "bench.json").is_file() else {}
    if data.get("schema") != SCHEMA:
        data = {"schema": SCHEMA}
    data.update(
        machine=machine,
        gpus=gpu_count(),
        time=time.strftime("%Y-%m-%d %H:%M"),
        host={
            "cpus": len(os.sched_getaffinity(0)),
            "mem_gib": psutil.virtual_memory().total / 2**30,
            "python": platform.python_version(),
        },
    )
    args.done = []
    with tempfile.TemporaryDirectory(prefix="dsexp-bench-") as tmp:
        work = Path(tmp)
        try:
            for name, run in sections:
                t = time.perf_counter()
                data[name] = {**run(args, work), "section_s": time.perf_counter() - t}
                args.done.append(name)
                (folder / "bench.json").write_text(json.dumps(data, indent=1))
                (folder / "bench.md").write_text(render(data) + "\n")
        finally:
            if args.keep:
                shutil.copytree(
                    work, args.keep, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.pt", "*.safetensors")
                )
    print(render(data))
    print(f"\nwrote {folder / 'bench.json'} and bench.md")
    return 0


def main_of(doc: str, section: str, add_arguments: Callable[[argparse.ArgumentParser], None], run: Run) -> int:
    """A benchmark's own command line: its options and the common ones, then its section alone."""
    ap = parser(doc)
    add_arguments(ap)
    return run_sections([(section, run)], ap.parse_args())
