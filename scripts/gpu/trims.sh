# Trims on one H200: internlm2_20b_shapes at tp=1 (AutoTP's init_inference, eager load), in one call of < 9 minutes.
#   trims_dedupe: baseline vs trim.dedupe_buffers=true (expect about -0.73 GiB of rotary tables on the device)
#   trims_env:    the context settings (trim.env), each against the baseline, with its generate tokens/s;
#                 CUDA_MODULE_LOADING=LAZY is the default made explicit: its spread from the baseline is the noise
#   trims_best:   dedupe + every setting expected to save memory, together (checks that the savings add up)
# Every job also records the memory outside PyTorch's allocator per rank (CUDA context, then the NCCL communicator
# of a first all_reduce: probe.first_collective=true, which a 1-rank job otherwise never creates; then load+init,
# generate). The reference (tp=1, untrimmed) is computed once and cached.
# Usage on the device machine (repo root, `.whl` carried): bash scripts/gpu/trims.sh
#   The sweeps stop at TRIMS_BUDGET s (default 500) in the order below (a job cut short is a failed result, the ones
#   before it are kept); the folder is packed after every sweep -> $OUT/h200_trims.tar.gz (every result.json, rank
#   logs, each sweep's report) and $OUT/summary_<sweep>.md. The analysis runs here afterwards, on CPU:
#     mkdir -p results/h200/trims && tar -xzf h200_trims.tar.gz -C results/h200/trims --strip-components=1
#     python -m dsexp.report results/h200/trims --no-mlflow
#     python scripts/gpu/trims_summary.py results/h200/trims > results/h200/trims/trims_h200.json
#     python benchmarks/trims_target.py --out results/h200/trims/target.md     # the tp=2 prediction vs 20.6 GiB
T0=$(date +%s)
BUDGET=${TRIMS_BUDGET:-500}   # seconds from here to the end of the sweeps (the device call allows 9 minutes)
source scripts/gpu/env.sh
ROOT=/tmp/sweeps/trims
mkdir -p $ROOT
M="experiment=autotp model=internlm2_20b_shapes tp=1 probe.first_collective=true probe.see_memory_usage=false generate.new_tokens=64 timeout_s=240"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
pack() {
  tar -czf "$OUT/h200_trims.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C "$(dirname $ROOT)" "$(basename $ROOT)" \
    || true
  for f in $ROOT/*/summary.md; do [ -f "$f" ] && cp "$f" "$OUT/summary_$(basename $(dirname $f)).md"; done || true
}
sweep() {  # sweep NAME OVERRIDES...
  local name=$1; shift
  local t=$(left)
  if [ "$t" -lt 60 ]; then echo "=== $name: skipped, ${t}s left"; return; fi
  echo "=== $name: $* ($(date +%T), ${t}s left)"
  timeout -s TERM -k 20 "$t" python3 -m dsexp -m "$@" $M hydra.sweep.dir=$ROOT/$name 2>&1 \
    | grep -E "^dsexp|^[0-9]+ |^job |Error" || true
  pack
}
sweep trims_dedupe trim.dedupe_buffers=false,true
sweep trims_env '++trim.env={PYTORCH_CUDA_ALLOC_CONF:"expandable_segments:True"},{CUBLAS_WORKSPACE_CONFIG:":0:0"},{NCCL_MAX_NCHANNELS:8},{CUDA_MODULE_LOADING:EAGER},{CUDA_MODULE_LOADING:LAZY},{NCCL_BUFFSIZE:1048576}'
sweep trims_best trim.dedupe_buffers=true '++trim.env={PYTORCH_CUDA_ALLOC_CONF:"expandable_segments:True",CUBLAS_WORKSPACE_CONFIG:":0:0",NCCL_MAX_NCHANNELS:8}'
df -h /tmp | tail -1
echo "total $(( $(date +%s) - T0 ))s"
ls -la "$OUT"
