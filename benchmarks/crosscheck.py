"""Compare dsexp's per-rank GPU figures with torch.cuda.max_memory_allocated and nvidia-smi from the same run.

Usage: python benchmarks/crosscheck.py SWEEP_DIR > crosscheck.md
(campaign matrix, sweep foundation: its jobs ran with probe.nvidia_smi=true)
"""

import json
import sys
from pathlib import Path

GIB = 2**30


def rounded(values: dict) -> dict:
    return {k: (round(v, 3) if isinstance(v, float) else v) for k, v in values.items()}


def main(sweep: Path) -> None:
    notes = []
    print(
        "| job | rank | phase | dsexp NVML process GiB | nvidia-smi process GiB | dsexp NVML device GiB "
        "| nvidia-smi device GiB "
        "| torch max_allocated GiB | torch max_reserved GiB | see_memory_usage Max_MA GB | weights on device GiB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for res_path in sorted(sweep.glob("*/result.json")):
        res = json.loads(res_path.read_text())
        name = f"{res['config']['model']['name']}/{res['config']['load']['name']}/tp{res['config']['tp']}"
        for rk in res.get("ranks") or []:
            for phase, ph in (rk or {}).get("phases", {}).items():
                g, smi, sm = ph.get("gpu") or {}, ph.get("nvidia_smi") or {}, ph.get("see_memory_usage") or {}
                cells = [
                    g.get("nvml_process_used"),
                    smi.get("smi_process_used"),
                    g.get("nvml_device_used"),
                    smi.get("smi_device_used"),
                    g.get("gpu_alloc_peak"),
                    g.get("gpu_reserved_peak"),
                ]
                fmt = ["-" if c is None else f"{c / GIB:.2f}" for c in cells]
                wd = ph.get("weights_device")
                print(
                    f"| {name} | {rk['rank']} | {phase} | "
                    + " | ".join(fmt)
                    + f" | {sm.get('Max_MA_GB', '-')} | {'-' if wd is None else f'{wd / GIB:.2f}'} |"
                )
        notes.append(
            f"- {name}: status {res['status']} {res.get('failure') and res['failure'].get('message') or ''} "
            f"headline {json.dumps(rounded(res.get('headline') or {}))} "
            f"runtime {json.dumps({k: v for k, v in (res.get('runtime') or {}).items() if k != 'model_dir'})}"
        )
    print("\n" + "\n".join(notes))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
