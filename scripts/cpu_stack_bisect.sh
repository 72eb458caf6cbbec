#!/usr/bin/env bash
# Issue 15's version bisection on CPU: which transformers release stopped giving every rank a private copy of the
# weights in from_pretrained. Two ranks (gloo) each load the `small` preset (bf16 safetensors, no dtype conversion)
# on transformers 4.42.4 .. 5.x (each a stack over the job environment, DeepSpeed 0.19.8 as today), then the table.
# Usage: bash scripts/cpu_stack_bisect.sh [SWEEP_DIR]   (about 15 minutes on 2 cores; needs the package index)
set -euo pipefail
sweep=${1:-multirun/cpu_stack_bisect}
py=${PYTHON:-.venv/bin/python}
out=results/cpu/stack_bisect
versions=4.42.4,4.43.0,4.44.2,4.45.2,4.46.3,4.47.1,4.48.3,4.49.0,4.50.0,4.51.3,4.52.4,4.53.3,4.54.1,4.55.4,4.56.2,4.57.6,5.0.0,null
"$py" -m dsexp -m stack.transformers=$versions model=small load=eager tp=2 check.correctness=false \
  generate.new_tokens=4 hydra.sweep.dir="$sweep"
mkdir -p "$out/sweep"
(cd "$sweep" && find . -name result.json -not -path "*/.dsexp/*" -exec cp --parents {} "$OLDPWD/$out/sweep/" \;)
"$py" scripts/stack_bisect_table.py "$out/sweep" > "$out/table.md"
cat "$out/table.md"
