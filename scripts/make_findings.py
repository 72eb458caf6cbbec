"""Build docs/FINDINGS.md from docs/FINDINGS.in.md and the committed results: no table is typed by hand.

Placeholders in the template:
  {{report:SECTION}}      a section of `python -m dsexp.report results/h200x2/sweeps --print SECTION`
  {{cpu:SECTION}}         the same for the CPU tp=1,2,4 sweep (results/cpu/tp_scaling/sweep)
  {{seed_table}}          the seed's reported figures next to dsexp's for the same call (see_memory_usage + per rank)
  {{cpu_holdout}}         the memory model checked out of sample: CPU tp=4 predicted from the tp=1,2 runs only,
                          against tp=4 measured
  {{trims:SECTION}}       a report section of the H200 trims sweeps (results/h200/trims)
  {{published:SECTION}}   a report section of the CPU sweep of InternLM2-like code as published
                          (results/cpu/published_code)
  {{published_gpu:SECTION}} the same on the H200 at internlm2_20b_shapes, both stacks (results/h200/published)
  {{any_model_stacks:SECTION}} transformers' own architectures on both stacks (results/cpu/any_model_stacks)
  {{gpu_stacks}}          the seed's call on each software stack, H200 (results/h200/stacks)
  {{stack_bisect}}        the transformers release bisection (results/cpu/stack_bisect)
  {{trims_target}}        the tp=2 prediction for the trimmed configuration (results/h200/trims/target.md)
  {{arch_matrix}}         the architecture matrix (results/cpu/arch_matrix.md, written by its slow test)
  {{example:PATH}}        a file of the repo, verbatim (the example script)
  {{shared:SECTION}}      a report section of the H200 runs with the ranks sharing the GPU (results/h200/shared)
  {{shared_target}}       the tp=2 trimmed configuration measured shared, NCCL added (results/h200/shared/target.md)
  {{capacity:SECTION}}    a report section of the H200 capacity grids (results/h200/capacity)
  {{scripts:SECTION}}     a report section of the seed's main.py run by the script workload (results/h200/scripts)
  {{seed_script_table}}   what the seed's own see_memory_usage calls printed in those runs, per run
  {{shared_tp_table}}     AutoTP at 20B shapes, tp=2/4/8 shared, untrimmed and trimmed: per rank against the model
  {{seed_two_commands}}   the seed's 2- and 4-GPU commands as its main.py runs them (24 layers), beside its report
  {{llm_analysis:SECTION}} a section of results/cpu/plan_vs_llm_analysis.md (dsexp.plan beside llm-analysis and the
                          H200; benchmarks/plan_vs_llm_analysis.py writes it): weights, above, largest, notes
  {{search_cost:measured}} the one-load budget searches measured beside the committed ones (results/cpu/search_cost.md,
                          written by benchmarks/search_cost.py)

Usage: `make findings` (rewrites docs/FINDINGS.md); `scripts/make_findings.py --check` fails if it is stale;
`scripts/make_findings.py --table gpu_stacks|stack_bisect FOLDER` prints one table (the campaigns' last steps).
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import sys
import tempfile
from pathlib import Path
from typing import Dict

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "results" / "h200x2" / "sweeps"
CPU = ROOT / "results" / "cpu" / "tp_scaling" / "sweep"
TRIMS = ROOT / "results" / "h200" / "trims"
PUBLISHED = ROOT / "results" / "cpu" / "published_code" / "sweep"
PUBLISHED_GPU = ROOT / "results" / "h200" / "published"
ANY_MODEL_STACKS = ROOT / "results" / "cpu" / "any_model_stacks"
STACKS = ROOT / "results" / "h200" / "stacks" / "sweeps"
BISECT = ROOT / "results" / "cpu" / "stack_bisect" / "sweep"
SHARED = ROOT / "results" / "h200" / "shared"
SCRIPTS = ROOT / "results" / "h200" / "scripts"
CAPACITY = ROOT / "results" / "h200" / "capacity"
LLM_ANALYSIS = ROOT / "results" / "cpu" / "plan_vs_llm_analysis.md"
SEARCH_COST = ROOT / "results" / "cpu" / "search_cost.md"
GIB = 2**30
PRIVATE = 0.5  # a rank "copies" when loading adds private memory of more than half the model

# The seed issue's own figures (DeepSpeed issue #5793): what its user read from see_memory_usage.
SEED_REPORTED = [("seed issue, 2 GPUs", 92.87, 37.74), ("seed issue, 4 GPUs", 162.92, 37.74)]


@functools.lru_cache(maxsize=None)
def report_sections(sweeps: Path, leave_out: str = "") -> Dict[str, str]:
    """Every section of the report on these sweeps, as `python -m dsexp.report SWEEPS --no-mlflow` writes it;
    built once per sweeps folder (into a scratch folder: the committed summary stays as it is). leave_out: the
    sweeps (sub-folders) whose runs stay out of it."""
    from dsexp.analysis.sources import results_from_dir
    from dsexp.analysis.summary import write_report

    keep = [d for d in sorted(sweeps.iterdir()) if d.is_dir() and d.name != leave_out]
    results = [r for d in keep for r in results_from_dir(d)]
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(sys.stderr):
        return write_report(sweeps, results=results, out_dir=Path(out), source=str(sweeps.relative_to(ROOT)))


def report_section(sweeps: Path, section: str, leave_out: str = "") -> str:
    # the report's own "## Section" headings sit under FINDINGS' numbered sections: one level down
    lines = report_sections(sweeps, leave_out)[section].splitlines()
    return "\n".join("#" + line if re.match(r"#{2,5} ", line) else line for line in lines).strip()


def _phase(rank: dict, name: str) -> dict:
    return (rank.get("phases") or {}).get(name) or {}


def seed_table() -> str:
    """The seed's see_memory_usage figures beside ours, for the seed's call (accepted form) and the private-copy
    load."""
    rows = [
        "| run | GPUs (tp) | see_memory_usage on rank 0 after init: MA / Max_CA (GB) "
        "| its 'CPU Virtual Memory used' after load / after init (GB) "
        "| dsexp: weights on each GPU (GiB) | dsexp: per-GPU peak, NVML (GiB) "
        "| dsexp: private host memory per rank, peak (GiB) "
        "| dsexp: node used, peak (GiB) |",
        "|---|---:|---|---:|---|---:|---|---:|",
    ]
    for label, cpu, ma in SEED_REPORTED:
        rows.append(
            f"| {label} (transformers 4.42, DeepSpeed 0.14.4) | {label.split(', ')[1].split()[0]} | {ma} / - "
            f"| {cpu} (which call: not stated) | - | - | - | - |"
        )
    runs = [
        ("seed call (accepted form), kernel injection", "seed_issue_accepted"),
        ("same model, AutoTP + policy, eager with bf16->fp16 conversion", "autotp_eager_meta"),
    ]
    for label, sweep in runs:
        for path in sorted((GPU / sweep).glob("*/result.json")):
            res = json.loads(path.read_text())
            cfg = res["config"]
            if sweep == "autotp_eager_meta" and not (
                cfg["load"]["name"] == "eager" and cfg["dtype"] != cfg["model"]["dtype"]
            ):
                continue
            ranks = [r for r in res["ranks"] if r]
            smu = _phase(ranks[0], "init").get("see_memory_usage") or {}
            smu_load = _phase(ranks[0], "load").get("see_memory_usage") or {}
            weights = " / ".join(f"{_phase(r, 'init').get('weights_device', 0) / GIB:.2f}" for r in ranks)
            h = res["headline"]
            rows.append(
                f"| dsexp: {label} | {cfg['tp']} | {smu.get('MA_GB', '-')} / {smu.get('Max_CA_GB', '-')} "
                f"| {smu_load.get('cpu_used_GB', '-')} / {smu.get('cpu_used_GB', '-')} | {weights} "
                f"| {h['gpu_peak_gib']:.2f} | {h['host_anon_peak_gib']:.2f} "
                f"| {h['node_host_peak_gib']:.2f} |"
            )
    return "\n".join(rows)


def _seed_printouts(rank0: dict) -> tuple:
    """What the seed's main.py printed through its own see_memory_usage calls on rank 0: (after load, after init)."""
    events = {e["message"]: e for e in (rank0.get("script") or {}).get("events") or [] if e.get("message")}
    return events.get("After load model") or {}, events.get("After DS-inference init") or {}


def seed_script_table() -> str:
    """The seed's main.py run unchanged (the script workload) on its own stack with its ranks sharing one H200: what
    its own see_memory_usage calls printed on rank 0, and what dsexp measured per rank and on the node."""
    rows = [
        "| run | tp | its 'After load model': CPU Virtual Memory used (GB) | its 'After DS-inference init': MA (GB) "
        "| dsexp: weights per rank after init (GiB) | dsexp: private host memory per rank at load, peak (GiB) "
        "| dsexp: node host peak (GiB) | correct |",
        "|---|---:|---:|---:|---|---|---:|---|",
    ]
    for path in sorted(SCRIPTS.glob("seed*/*/result.json")):  # the seed's main.py (not the other scripts)
        res = json.loads(path.read_text())
        if res.get("status") != "ok":
            continue
        cfg, ranks = res["config"], [r for r in res["ranks"] if r]
        load, init = _seed_printouts(ranks[0])
        fixes = ",".join(cfg["script"]["fix"]) or "as written"
        layers = "24 layers" if path.parts[-3].startswith("seed24") else "48 layers"
        weights = " / ".join(f"{_phase(r, 'init').get('weights_device', 0) / GIB:.2f}" for r in ranks)
        anon = " / ".join(f"{(_phase(r, 'load').get('peaks') or {}).get('host_anon_peak', 0) / GIB:.2f}" for r in ranks)
        corr = res.get("correctness") or {}
        ok = "-" if not corr else f"yes ({corr['logits_rel_err']:.4f})" if corr.get("passed") else "no"
        rows.append(
            f"| main.py, {fixes}, {layers} | {cfg['tp']} | {load.get('cpu_used_GB', '-')} | {init.get('MA_GB', '-')} "
            f"| {weights} | {anon} | {res['headline']['node_host_peak_gib']:.2f} | {ok} |"
        )
    return "\n".join(rows)


def seed_two_commands() -> str:
    """The seed's two commands (2 and 4 GPUs) as its main.py runs them, at 24 layers so that four whole copies fit
    the one H200 and its host: per GPU (its own see_memory_usage, dsexp's census and NVML per process) and per host,
    beside the seed's own report at 48 layers."""
    rows = [
        "| run | GPUs (tp) | its MA after init (GB) | weights per GPU (GiB) | per-GPU peak (GiB) "
        "| its 'CPU Virtual Memory used' after load (GB) | private host memory per rank at load (GiB) "
        "| node host peak (GiB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, reported_host, reported_ma in SEED_REPORTED:
        rows.append(
            f"| {name} (48 layers) | {name.split(', ')[1][0]} | {reported_ma} | - | - | {reported_host} | - | - |"
        )
    for path in sorted(SCRIPTS.glob("seed24*/*/result.json")):
        res = json.loads(path.read_text())
        if res.get("status") != "ok":
            continue
        ranks = [r for r in res["ranks"] if r]
        load, init = _seed_printouts(ranks[0])
        weights = max(_phase(r, "init").get("weights_device", 0) for r in ranks) / GIB
        anon = max((_phase(r, "load").get("peaks") or {}).get("host_anon_peak", 0) for r in ranks) / GIB
        rows.append(
            f"| main.py as written, 24 layers, ranks sharing one H200 | {res['config']['tp']} "
            f"| {init.get('MA_GB', '-')} | {weights:.2f} | {res['headline']['gpu_peak_gib']:.2f} "
            f"| {load.get('cpu_used_GB', '-')} | {anon:.2f} | {res['headline']['node_host_peak_gib']:.2f} |"
        )
    return "\n".join(rows)


def shared_tp_table() -> str:
    """AutoTP at 20B shapes, untrimmed and trim=all, at tp=2, 4 and 8 with the ranks sharing the one H200: per rank
    the census of weights, the allocator's peak of allocated bytes (the tensors), its reserve after init (the
    segments holding them) and NVML's figure for the process, each against the memory model (weights, their
    allocator reserve replayed, + KV cache; NVML adds the memory outside the allocator measured in the same run)."""
    from dsexp.analysis.matrix import build_rows
    from dsexp.analysis.sources import results_from_dir

    results = [r for d in ("autotp2", "autotp2_trim", "autotp4", "autotp8") for r in results_from_dir(SHARED / d)]
    results = [r for r in results if not r["config"]["probe"]["memory_snapshot"]]  # the snapshots' cost run aside
    rows = [
        "| tp | trims | weights per rank: measured / model (GiB) | Δ | allocated peak per rank: measured / model "
        "(GiB) | Δ | reserved after init: measured / replayed (GiB) | Δ | NVML per process, peak: measured / model "
        "+ outside (GiB) | Δ | correct (rel. err) |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]

    def pct(a, b):
        return f"{(a / b - 1) * 100:+.1f}%"

    for row in sorted(build_rows(results), key=lambda r: (bool(r.config.get("trim", {}).get("name") != "none"), r.tp)):
        job, p = row.record, row.prediction
        weights = max(rk.phase("init").weights_device for rk in job.ranks)
        allocated = max(ph.gpu.get("gpu_alloc_peak") or 0 for rk in job.ranks for ph in rk.phases())
        reserved = max(rk.phase("init").gpu.get("gpu_reserved") or 0 for rk in job.ranks)
        process = max(rk.max_over_phases("nvml_process_used") or 0 for rk in job.ranks)
        model = max(w + k for w, k in zip(p.weights, p.kv_cache))
        held = max(r + k for r, k in zip(p.reserve, p.kv_cache))
        outside = max((ph.gpu.get("nvml_process_used") or 0) - (ph.gpu.get("gpu_reserved") or 0)
                      for rk in job.ranks for ph in rk.phases())  # fmt: skip
        corr = job.correctness
        rows.append(
            f"| {row.tp} | {row.config.get('trim', {}).get('name')} | {weights / GIB:.2f} / {p.weights_max / GIB:.2f} "
            f"| {pct(weights, p.weights_max)} | {allocated / GIB:.2f} / {model / GIB:.2f} | {pct(allocated, model)} "
            f"| {reserved / GIB:.3f} / {max(p.reserve) / GIB:.3f} | {pct(reserved, max(p.reserve))} "
            f"| {process / GIB:.2f} / {(held + outside) / GIB:.2f} | {pct(process, held + outside)} "
            f"| {'yes' if corr.get('passed') else 'no'} ({corr.get('logits_rel_err', 0):.4f}) |"
        )
    return "\n".join(rows)


def cpu_holdout() -> str:
    """Predict tp=4 from the CPU sweep's tp<=2 runs alone (as a user with 2 GPUs would) and set it against tp=4
    measured.

    Node figures are compared as growth during the job (peak used - used before launch): the machine's
    baseline differs from run to run (other processes), and the prediction carries the tp=2 run's."""
    from dsexp.analysis.matrix import build_rows, extrapolate
    from dsexp.analysis.measured import node_growth

    results = [json.loads(p.read_text()) for p in sorted(CPU.glob("*/result.json"))]
    at4 = {r.strategy: r for r in build_rows([x for x in results if x["config"]["tp"] == 4])}
    base = {r.strategy: r for r in build_rows([x for x in results if x["config"]["tp"] == 2])}
    predicted = [
        e for e in extrapolate(build_rows([x for x in results if x["config"]["tp"] <= 2]), (4,)) if not e.measured
    ]
    rows = [
        "| configuration | weights per rank, predicted / measured (MiB) "
        "| host peak per rank, predicted / measured (GiB) "
        "| node growth during the job, predicted / measured (GiB) |",
        "|---|---|---|---|",
    ]

    def pair(pred, meas, scale=1.0, nd=2) -> str:
        if pred is None or meas is None:
            return "-"
        return f"{pred * scale:.{nd}f} / {meas * scale:.{nd}f} ({100 * (pred - meas) / meas:+.0f}%)"

    for e in predicted:
        if e.strategy not in at4:
            continue
        v, r4 = at4[e.strategy].values(), at4[e.strategy].result
        growth_pred = (
            None
            if e.node_host_peak_gib is None
            else e.node_host_peak_gib - base[e.strategy].result["baseline"]["node_used"] / GIB
        )
        growth = node_growth(r4)
        rows.append(
            f"| {e.strategy} | {pair(e.weights_gib, v['gpu_weights_gib'], 1024, 1)} "
            f"| {pair(e.host_peak_gib, v['host_peak_gib'])} "
            f"| {pair(growth_pred, None if growth is None else growth / GIB)} |"
        )
    return "\n".join(rows)


def _fmt(v, nd=2):
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def _stack_row(res) -> str:
    c, ranks = res["config"], res.get("ranks") or []
    r0 = (ranks[0] if ranks else {}) or {}
    versions = (res.get("software") or {}).get("versions") or {}
    load, init = _phase(r0, "load"), _phase(r0, "init")
    smu, smu_load, gpu = init.get("see_memory_usage") or {}, load.get("see_memory_usage") or {}, init.get("gpu") or {}
    hosts = [_phase(r or {}, "load").get("host", {}) for r in ranks]
    anon, uss = [h.get("host_anon") for h in hosts], [h.get("host_uss") for h in hosts]
    node = max([h.get("node_used") or 0 for h in hosts] or [0])
    failure = res.get("failure") or {}
    message = " ".join(str(failure.get("message")).split())[:90]
    cells = [
        ((c.get("stack") or {}).get("name") or "current"),
        f"transformers {versions.get('transformers', '-')}, deepspeed {versions.get('deepspeed', '-')}",
        c.get("variant"),
        (res.get("runtime") or {}).get("device"),
        c["tp"],
        "ok" if res["status"] == "ok" else f"{failure.get('cause')}: {message}",
        f"{_fmt(smu.get('MA_GB'))} / {_fmt(smu.get('Max_MA_GB'))}",
        f"{_fmt(smu_load.get('cpu_used_GB'))} / {_fmt(smu.get('cpu_used_GB'))}",
        _fmt((gpu.get("gpu_alloc") or 0) / GIB if gpu else None),
        _fmt((gpu.get("nvml_process_used") or 0) / GIB if gpu.get("nvml_process_used") else None),
        " / ".join(_fmt(a / GIB) for a in anon if a is not None) or "-",
        " / ".join(_fmt(u / GIB) for u in uss if u is not None) or "-",
        _fmt(node / GIB if node else None),
        _fmt(load.get("wall_s"), 1),
    ]
    return "| " + " | ".join(str(x) for x in cells) + " |"


def gpu_stacks(folder: Path = STACKS) -> str:
    """The seed's call on each software stack (campaign stacks): what DeepSpeed's see_memory_usage printed next to
    dsexp's figures, and host memory per rank and node after load."""
    from dsexp.analysis.sources import results_from_dir

    rows = [
        "| stack | versions the ranks imported | call | device | tp | status | see_memory_usage after init: MA / "
        "Max_MA (GB) | see_memory_usage 'CPU Virtual Memory used' after load / after init (GB) | dsexp: torch "
        "allocated after init (GiB) | dsexp: NVML process after init (GiB) | private host memory per rank after load "
        "(GiB) | USS per rank after load (GiB) | node used after load (GiB) | load (s) |",
        "|---|---|---|---|---:|---|---|---|---:|---:|---|---|---:|---:|",
    ]
    return "\n".join(rows + [_stack_row(res) for res in results_from_dir(folder)])


def _bisect_rows(folder: Path):
    from packaging.version import Version

    from dsexp.analysis.sources import results_from_dir

    out = []
    for res in results_from_dir(folder):
        ranks = [r for r in res.get("ranks") or [] if r]
        version = ((res.get("software") or {}).get("versions") or {}).get("transformers")
        if not ranks or version is None:
            failure = res.get("failure") or {}
            out.append((res["config"]["stack"].get("transformers") or "job env", None, failure.get("cause"), []))
            continue
        model = (ranks[0]["phases"]["load"].get("weights") or {}).get("param_bytes", {}).get("cpu", 0)
        loads = [(r["phases"]["start"]["host"], r["phases"]["load"]["host"]) for r in ranks]
        out.append((version, model, res["status"], loads))
    return sorted(out, key=lambda r: Version(r[0]) if r[0][0].isdigit() else Version("99"))


def stack_bisect(folder: Path = BISECT) -> str:
    """The transformers release bisection (campaign cpu_stack_bisect): private host memory each rank adds while
    from_pretrained loads (USS after load - USS at the end of start, which already holds the interpreter, torch and
    transformers), by release, and the first release from which the ranks no longer make private copies."""
    rows = [
        "| transformers | status | model (GiB) | private memory added by the load, per rank: USS (GiB) "
        "| anon (GiB) | file-backed pages mapped after load, per rank (GiB) | private copy? |",
        "|---|---|---:|---|---|---|---|",
    ]
    first_shared, copying = None, False
    for version, model, status, loads in _bisect_rows(folder):
        if not loads:
            rows.append(f"| {version} | {status} | - | - | - | - | - |")
            continue
        uss = [load["host_uss"] - start["host_uss"] for start, load in loads]
        anon = [load["host_anon"] - start["host_anon"] for start, load in loads]
        copies = max(uss) > PRIVATE * model
        if copying and not copies and first_shared is None:
            first_shared = version
        copying = copies if first_shared is None else copying
        cells = [version, status, f"{model / GIB:.2f}", " / ".join(f"{u / GIB:.2f}" for u in uss)]
        cells += [" / ".join(f"{a / GIB:.2f}" for a in anon)]
        cells += [" / ".join(f"{load['host_file'] / GIB:.2f}" for _, load in loads)]
        rows.append("| " + " | ".join(cells + ["yes" if copies else "no"]) + " |")
    rows += [
        "",
        f"First release whose ranks make no private copy after a copying one: **{first_shared or 'none found'}** "
        f"(a copy: the load adds private memory (USS) of more than {PRIVATE:.0%} of the model).",
    ]
    return "\n".join(rows)


def committed_table(path: Path) -> str:
    """A committed markdown file without its heading or generator comment."""
    lines = [ln for ln in path.read_text().splitlines() if not ln.startswith(("# ", "<!--"))]
    return "\n".join(lines).strip()


def committed_section(path: Path, name: str) -> str:
    """The part of a committed markdown file after its `<!-- section: NAME -->` marker, up to the next marker or
    heading."""
    lines = path.read_text().splitlines()
    start = lines.index(f"<!-- section: {name} -->") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith(("<!-- section:", "#"))), len(lines))
    return "\n".join(lines[start:end]).strip()


def render(template: str) -> str:
    def sub(m: re.Match) -> str:
        kind, _, arg = m.group(1).partition(":")
        if kind == "report":
            return report_section(GPU, arg)
        if kind == "cpu":
            return report_section(CPU, arg)
        if kind == "seed_table":
            return seed_table()
        if kind == "cpu_holdout":
            return cpu_holdout()
        if kind == "trims":
            return report_section(TRIMS, arg)
        if kind == "published":
            return report_section(PUBLISHED, arg)
        if kind == "published_gpu":
            return report_section(PUBLISHED_GPU, arg)
        if kind == "any_model_stacks":
            return report_section(ANY_MODEL_STACKS, arg)
        if kind == "gpu_stacks":
            return gpu_stacks()
        if kind == "stack_bisect":
            return stack_bisect()
        if kind == "trims_target":
            return committed_table(TRIMS / "target.md")
        if kind == "shared":  # the 20B runs; the tiny checks of every engine (check/) stay out
            return report_section(SHARED, arg, leave_out="check")
        if kind == "shared_tp_table":
            return shared_tp_table()
        if kind == "seed_two_commands":
            return seed_two_commands()
        if kind == "shared_target":
            return committed_table(SHARED / "target.md")
        if kind == "scripts":
            return report_section(SCRIPTS, arg)
        if kind == "capacity":
            return report_section(CAPACITY, arg)
        if kind == "seed_script_table":
            return seed_script_table()
        if kind == "example":
            return (ROOT / arg).read_text().strip()
        if kind == "arch_matrix":
            return committed_table(ROOT / "results" / "cpu" / "arch_matrix.md")
        if kind == "llm_analysis":
            return committed_section(LLM_ANALYSIS, arg)
        if kind == "search_cost":
            return committed_section(SEARCH_COST, arg)
        raise KeyError(m.group(0))

    return re.sub(r"\{\{([a-z_]+(?::[a-z_./]+)?)\}\}", sub, template)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--table"]:  # a campaign's step: one table from the folder it just filled
        print({"gpu_stacks": gpu_stacks, "stack_bisect": stack_bisect}[argv[1]](Path(argv[2])))
        return 0
    text = render((ROOT / "docs" / "FINDINGS.in.md").read_text())
    target = ROOT / "docs" / "FINDINGS.md"
    if "--check" in argv:
        return 0 if target.is_file() and target.read_text() == text else 1
    target.write_text(text)
    print(f"wrote {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
