#!/usr/bin/env bash
# Issue 7's CPU stand-in for 4/8 GPUs: host memory per rank and per node as tp grows (1, 2, 4) for each loading
# strategy, on gloo with the `small` preset (~160 M params: 305 MiB bf16 / 610 MiB fp32 on disk), then the report.
# Usage: bash scripts/cpu_tp_scaling.sh [SWEEP_DIR]   (about 20 minutes on 2 cores)
set -euo pipefail
sweep=${1:-multirun/cpu_tp_scaling}
py=${PYTHON:-.venv/bin/python}
out=results/cpu/tp_scaling
"$py" -m dsexp -m model=small tp=1,2,4 load=eager,meta,sharded model.dtype=bf16,fp32 dtype=bf16 \
  hydra.sweep.dir="$sweep"
# keep what the report is built from (result.json files only), then rebuild the report from the kept copy
mkdir -p "$out/sweep"
(cd "$sweep" && find . -name result.json -not -path "*/.dsexp/*" -exec cp --parents {} "$OLDPWD/$out/sweep/" \;)
"$py" -m dsexp.report "$out/sweep" --no-mlflow --out "$out"
