"""The seed's call on each software stack, as a markdown table: what DeepSpeed's see_memory_usage printed next to
dsexp's figures, and host memory per rank and node after load. Usage: stack_table.py SWEEPS_DIR (every result.json
below it)."""

from __future__ import annotations

import sys
from pathlib import Path

from dsexp.analysis.sources import results_from_dir

GIB = 2**30


def fmt(v, nd=2):
    return "-" if v is None else f"{v:.{nd}f}" if isinstance(v, float) else str(v)


def phase(rank, name):
    return ((rank or {}).get("phases") or {}).get(name) or {}


def row(res) -> str:
    c, ranks = res["config"], res.get("ranks") or []
    r0 = ranks[0] if ranks else {}
    versions = (res.get("software") or {}).get("versions") or {}
    load, init = phase(r0, "load"), phase(r0, "init")
    smu = init.get("see_memory_usage") or {}
    smu_load = load.get("see_memory_usage") or {}
    gpu = init.get("gpu") or {}
    anon = [phase(r, "load").get("host", {}).get("host_anon") for r in ranks]
    uss = [phase(r, "load").get("host", {}).get("host_uss") for r in ranks]
    node = max([phase(r, "load").get("host", {}).get("node_used") or 0 for r in ranks] or [0])
    failure = res.get("failure") or {}
    message = " ".join(str(failure.get("message")).split())[:90]
    status = "ok" if res["status"] == "ok" else f"{failure.get('cause')}: {message}"
    cells = [
        ((c.get("stack") or {}).get("name") or "current"),
        f"transformers {versions.get('transformers', '-')}, deepspeed {versions.get('deepspeed', '-')}",
        c.get("variant"),
        (res.get("runtime") or {}).get("device"),
        c["tp"],
        status,
        f"{fmt(smu.get('MA_GB'))} / {fmt(smu.get('Max_MA_GB'))}",
        f"{fmt(smu_load.get('cpu_used_GB'))} / {fmt(smu.get('cpu_used_GB'))}",
        fmt((gpu.get("gpu_alloc") or 0) / GIB if gpu else None),
        fmt((gpu.get("nvml_process_used") or 0) / GIB if gpu.get("nvml_process_used") else None),
        " / ".join(fmt(a / GIB) for a in anon if a is not None) or "-",
        " / ".join(fmt(u / GIB) for u in uss if u is not None) or "-",
        fmt(node / GIB if node else None),
        fmt(load.get("wall_s"), 1),
    ]
    return "| " + " | ".join(str(x) for x in cells) + " |"


def main(folder: Path) -> None:
    print(
        "| stack | versions the ranks imported | call | device | tp | status | see_memory_usage after init: MA / "
        "Max_MA (GB) | see_memory_usage 'CPU Virtual Memory used' after load / after init (GB) | dsexp: torch "
        "allocated after init (GiB) | dsexp: NVML process after init (GiB) | private host memory per rank after load "
        "(GiB) | USS per rank after load (GiB) | node used after load (GiB) | load (s) |"
    )
    print("|---|---|---|---|---:|---|---|---|---:|---:|---|---|---:|---:|")
    for res in results_from_dir(folder):
        print(row(res))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
