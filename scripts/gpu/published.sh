# Issue 16 on one H200: InternLM2's code as published (dsexp's InternLM2 behaves like it) at internlm2_20b_shapes,
# tp=1, AutoTP with the policy inferred (the published code gives DeepSpeed none), eager and meta loads, with the
# rotary buffers left as loaded (load.restore_buffers=false) and recomputed by dsexp (true, the default).
#   bash scripts/gpu/published.sh current   # transformers 5.17 + DeepSpeed 0.19.8 (expect a NaN reference)
#   bash scripts/gpu/published.sh seed      # transformers 4.42.4 + DeepSpeed 0.14.4 (carry .gpuwheels too)
# Carry .whl (and .gpuwheels for seed). Packs $OUT/published_<stack>.tar.gz (result.json, rank logs, summary).
# Here afterwards: tar -xzf published_<stack>.tar.gz -C results/h200/published; make_findings renders the matrix.
T0=$(date +%s)
BUDGET=${PUBLISHED_BUDGET:-540}
STACK=${1:?usage: published.sh current|seed}
source scripts/gpu/env.sh
ROOT=/tmp/sweeps
M="experiment=autotp model=internlm2_20b_shapes tp=1 engine.injection_policy=infer generate.new_tokens=16"
M="$M probe.see_memory_usage=false timeout_s=240 stack=$STACK"
if [ "$STACK" = seed ]; then
  M="$M stack.wheelhouse=$PWD/.gpuwheels/seed"
  python3 -m dsexp.stacks prepare stack=seed stack.wheelhouse=$PWD/.gpuwheels/seed cache_dir=$DSEXP_CACHE | tail -3
fi
echo "=== published_$STACK ($(date +%T))"
timeout -s TERM -k 20 $(( BUDGET - ($(date +%s) - T0) )) python3 -m dsexp -m load=eager,meta \
  load.restore_buffers=false,true $M hydra.sweep.dir=$ROOT/published_$STACK 2>&1 \
  | grep -E "^dsexp|^[0-9]+ |^job |Error" || true
tar -czf "$OUT/published_$STACK.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C $ROOT "published_$STACK"
cp $ROOT/published_$STACK/summary.md "$OUT/summary_$STACK.md" 2>/dev/null || true
