# Issue 35 on the one-H200 machine: the budget search at internlm2_20b_shapes, 2048 tokens of context, each rank's
# allocator capped at the budget (ranks sharing the GPU: launcher.gpus=1, so tp ranks x budget.gpu_gib must fit the
# H200's memory: tp=4 at 24 GiB, tp=2 at 40 GiB). The searches stop at BUDGET s from the start (default 540), in the
# order below (what a cut budget loses last first); a search cut short resumes with the same command (its folder).
# Usage (repo root, `.whl` carried): bash scripts/gpu/budget.sh   (ONLY='gpu24' runs that search alone)
#   -> $OUT/budget.tar.gz (results, reports, budget.json; no checkpoints)
# Then, here: mkdir -p results/h200/budget && tar -xzf budget.tar.gz -C results/h200/budget --strip-components=1
T0=$(date +%s)
BUDGET=${BUDGET:-540}
source scripts/gpu/env.sh
set +e
ROOT=/tmp/sweeps/budget
mkdir -p $ROOT
M="model=internlm2_20b_shapes experiment=autotp engine.injection_policy=infer launcher.gpus=1
   generate.prompt_tokens=2048 generate.new_tokens=${NEW_TOKENS:-8} budget.batch_max=${BATCH_MAX:-64}
   budget.host_gib=64 probe.see_memory_usage=false"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
pack() {
  tar -czf "$OUT/budget.tar.gz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.pickle' \
    -C "$(dirname $ROOT)" "$(basename $ROOT)" || true
}
search() {  # search NAME OVERRIDES... (only the names in $ONLY, where it is set)
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local t=$(left)
  if [ "$t" -lt 60 ]; then echo "=== $name: skipped, ${t}s left"; return; fi
  echo "=== $name: $* ($(date +%T), ${t}s left)"
  timeout -s INT -k 30 "$t" python3 -m dsexp -m "$@" $M timeout_s=${JOB_TIMEOUT:-300} hydra.sweep.dir=$ROOT/$name \
    2>&1 | grep -E "^dsexp|^  not launched|^[0-9]+ |^job " || true
  python3 -m dsexp.report $ROOT/$name --print budget > "$OUT/$name.md" 2>/dev/null || true
  pack
}
search gpu24 budget.gpus=4 budget.gpu_gib=24 tp=1,2,4 load=meta trim=none,all
search gpu40 budget.gpus=2 budget.gpu_gib=40 tp=1,2 load=meta trim=none,all
search gpu24_loads budget.gpus=4 budget.gpu_gib=24 tp=2,4 load=eager,sharded trim=none,all
nvidia-smi --query-gpu=memory.used --format=csv
echo "total $(( $(date +%s) - T0 ))s"
