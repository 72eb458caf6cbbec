# Issue 23 on the one-H200 machine: ranks sharing the GPU (launcher.gpus=1, gloo), measured per rank at
# internlm2_20b_shapes (the published-style InternLM2 code): AutoTP with the inferred policy, untrimmed and trim=all,
# at tp=2, 4 and 8, and ZeRO-3 as the peer at tp=2 (transformers TP is refused shared: results/h200/shared/check).
# The first pair also measures PyTorch memory snapshots' cost (probe.memory_snapshot=false,true: issue 26).
# The sweeps stop at BUDGET s from the start (default 540) in the order below; the folder is packed after every sweep.
# Usage (repo root, `.whl` carried): bash scripts/gpu/shared.sh
#   -> $OUT/shared.tar.gz (results, reports, traces; no pickles), snapshots_overhead.{md,json}, snapshot_summary.json
# Then, here: mkdir -p results/h200/shared && tar -xzf shared.tar.gz -C results/h200/shared --strip-components=1
T0=$(date +%s)
BUDGET=${BUDGET:-540}
source scripts/gpu/env.sh
set +e
ROOT=/tmp/sweeps/shared
mkdir -p $ROOT
M="model=internlm2_20b_shapes launcher.gpus=1 generate.new_tokens=8 timeout_s=300"
M="$M probe.see_memory_usage=false probe.first_collective=true"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
pack() {
  tar -czf "$OUT/shared.tar.gz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.pickle' \
    -C "$(dirname $ROOT)" "$(basename $ROOT)" || true
}
sweep() {  # sweep NAME OVERRIDES...
  local name=$1; shift
  local t=$(left)
  if [ "$t" -lt 50 ]; then echo "=== $name: skipped, ${t}s left"; return; fi
  echo "=== $name: $* ($(date +%T), ${t}s left)"
  timeout -s TERM -k 20 "$t" python3 -m dsexp -m "$@" $M hydra.sweep.dir=$ROOT/$name 2>&1 \
    | grep -E "^dsexp: (ok|failed)|^[0-9]+ |^job " || true
  pack
}
sweep autotp2 experiment=autotp engine.injection_policy=infer tp=2 trim=none probe.memory_snapshot=false,true
sweep autotp2_trim experiment=autotp engine.injection_policy=infer tp=2 trim=all
sweep zero3 experiment=zero3 tp=2
sweep autotp4 experiment=autotp engine.injection_policy=infer tp=4 trim=all,none
sweep autotp8 experiment=autotp engine.injection_policy=infer tp=8 trim=all,none
python3 scripts/gpu/snapshots_summary.py $ROOT/autotp2 "$OUT/snapshots_overhead" || true
python3 -m dsexp.analysis.snapshot_summary $ROOT/autotp2 --top 20 --out "$OUT/snapshot_summary.json" || true
nvidia-smi --query-gpu=memory.used --format=csv
echo "total $(( $(date +%s) - T0 ))s"
