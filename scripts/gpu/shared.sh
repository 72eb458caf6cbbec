# Issue 23 on the one-H200 machine: ranks sharing the GPU (launcher.gpus=1, gloo), measured per rank at
# internlm2_20b_shapes (the published-style InternLM2 code): AutoTP with the inferred policy, untrimmed and trim=all,
# at tp=2, 4 and 8, and ZeRO-3 as the peer at tp=2 (transformers TP is refused shared: results/h200/shared/check).
# The first pair also measures PyTorch memory snapshots' cost (probe.memory_snapshot=false,true: issue 26).
# The sweeps stop at BUDGET s from the start (default 540) in the order below; the folder is packed after every sweep.
# ONLY='autotp4 autotp8' runs those sweeps alone, in the order below (the largest tp first: what a cut budget loses last).
# Usage (repo root, `.whl` carried): bash scripts/gpu/shared.sh
#   -> $OUT/shared.tar.gz (results, reports, traces; no pickles), snapshots_overhead.{md,json}, snapshot_summary.json
# Then, here: mkdir -p results/h200/shared && tar -xzf shared.tar.gz -C results/h200/shared --strip-components=1
T0=$(date +%s)
BUDGET=${BUDGET:-540}
source scripts/gpu/env.sh
set +e
ROOT=/tmp/sweeps/shared
mkdir -p $ROOT
M="model=internlm2_20b_shapes launcher.gpus=1 probe.see_memory_usage=false probe.first_collective=true"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
pack() {
  tar -czf "$OUT/shared.tar.gz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.pickle' \
    -C "$(dirname $ROOT)" "$(basename $ROOT)" || true
}
sweep() {  # sweep NAME OVERRIDES... (only the names in $ONLY, where it is set)
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local t=$(left)
  if [ "$t" -lt 50 ]; then echo "=== $name: skipped, ${t}s left"; return; fi
  echo "=== $name: $* ($(date +%T), ${t}s left)"
  timeout -s TERM -k 20 "$t" python3 -m dsexp -m "$@" $M generate.new_tokens=${NEW_TOKENS:-8} \
    timeout_s=${JOB_TIMEOUT:-300} hydra.sweep.dir=$ROOT/$name 2>&1 \
    | grep -E "^dsexp: (ok|failed)|^[0-9]+ |^job " || true
  pack
}
sweep autotp8 experiment=autotp engine.injection_policy=infer tp=8 trim=none,all
sweep autotp4 experiment=autotp engine.injection_policy=infer tp=4 trim=none,all
sweep autotp2 experiment=autotp engine.injection_policy=infer tp=2 trim=none probe.memory_snapshot=false,true
sweep autotp2_trim experiment=autotp engine.injection_policy=infer tp=2 trim=all
# ZeRO-3 gathers every layer over gloo at each forward (about 40 GB a token at 20B): two new tokens, a longer timeout.
NEW_TOKENS=2 JOB_TIMEOUT=480 sweep zero3 experiment=zero3 tp=2
python3 scripts/gpu/snapshots_summary.py $ROOT/autotp2 "$OUT/snapshots_overhead" || true
python3 -m dsexp.analysis.snapshot_summary $ROOT/autotp2 --top 20 --out "$OUT/snapshot_summary.json" || true
nvidia-smi --query-gpu=memory.used --format=csv
echo "total $(( $(date +%s) - T0 ))s"
