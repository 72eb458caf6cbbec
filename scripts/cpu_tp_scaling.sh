#!/usr/bin/env bash
# Issue 7's CPU stand-in for 4/8 GPUs: host memory per rank and per node as tp grows (1, 2, 4) for each loading
# strategy, on gloo with the `small` preset (~160 M params: 305 MiB bf16 / 610 MiB fp32 on disk), then the report.
# Usage: bash scripts/cpu_tp_scaling.sh [SWEEP_DIR]   (about 30 minutes on 2 cores)
set -euo pipefail
sweep=${1:-multirun/cpu_tp_scaling}
py=${PYTHON:-.venv/bin/python}
"$py" -m dsexp -m model=small tp=1,2,4 load=eager,meta,sharded model.dtype=bf16,fp32 dtype=bf16 \
  hydra.sweep.dir="$sweep"
"$py" -m dsexp.report "$sweep"
mkdir -p results/cpu/tp_scaling
cp -r "$sweep/summary.md" "$sweep/summary.csv" "$sweep/plots" results/cpu/tp_scaling/
