# Issues 23-25 on the one-H200 machine: the seed's main.py as its author wrote it (tests/data/seed_main.py, its model
# path aside), run by the script workload on the seed's own stack (transformers 4.42.4 + DeepSpeed 0.14.4) with its
# ranks sharing the GPU: at internlm2_20b_shapes, tp=2 as written and with script.fix=all (tp=4 fixed last), and the
# seed's two commands (tp=2 against tp=4) at a 24-layer scale where four whole copies fit host and GPU; then a script
# that moves the model to the GPU before init_inference, as written and fixed. generate is capped at 16 tokens
# (script.max_new_tokens) to fit the call; the seed asks for 1024.
# ONLY='seed20_tp4 moves' runs those sweeps alone (each call is a fresh machine: the checkpoints are rewritten).
# Usage (repo root; carry .whlmin: dsexp's job wheels without MLflow, and .gpuwheels/seedmin: the seed stack's five
# wheels, which with MLflow's would exceed what a call carries): WHEELS=.whlmin bash scripts/gpu/scripts.sh
T0=$(date +%s)
BUDGET=${BUDGET:-560}
source scripts/gpu/env.sh
set +e
export USE_FLAX=0  # transformers 4.42.4 imports the image's flax and jax (built for numpy 2) without it
ROOT=/tmp/sweeps/scripts
mkdir -p $ROOT
python3 -m dsexp.stacks prepare stack=seed stack.wheelhouse=$PWD/.gpuwheels/seedmin cache_dir=$DSEXP_CACHE | tail -3
D20=$(python3 scripts/gpu/model_dir.py model=internlm2_20b_shapes cache_dir=$DSEXP_CACHE | tail -1)
D24=$(python3 scripts/gpu/model_dir.py model=internlm2_20b_shapes model.dims.num_hidden_layers=24 cache_dir=$DSEXP_CACHE | tail -1)
DT=$(python3 scripts/gpu/model_dir.py model=internlm2_tiny cache_dir=$DSEXP_CACHE | tail -1)
mkdir -p /tmp/seed20 /tmp/seed24
bash scripts/gpu/seed_main.sh "$D20" /tmp/seed20/main.py
bash scripts/gpu/seed_main.sh "$D24" /tmp/seed24/main.py
python3 -c "import sys; sys.path.insert(0, 'tests'); from helpers.user_scripts import write_script; write_script('/tmp', 'moves_first.py', '$DT')"
echo "checkpoints ready at $(( $(date +%s) - T0 ))s: $D20 $D24"
S="launcher=deepspeed stack=seed stack.wheelhouse=$PWD/.gpuwheels/seedmin launcher.gpus=1 script.max_new_tokens=16 timeout_s=420"
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
pack() {
  tar -czf "$OUT/scripts.tar.gz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.pickle' \
    -C "$(dirname $ROOT)" "$(basename $ROOT)" || true
  for f in $ROOT/*/summary.md; do [ -f "$f" ] && cp "$f" "$OUT/summary_$(basename $(dirname $f)).md"; done
}
sweep() {  # sweep NAME OVERRIDES... (only the names in $ONLY, where it is set)
  local name=$1; shift
  if [ -n "$ONLY" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  local t=$(left)
  if [ "$t" -lt 60 ]; then echo "=== $name: skipped, ${t}s left"; return; fi
  echo "=== $name: $* ($(date +%T), ${t}s left)"
  timeout -s TERM -k 20 "$t" python3 -m dsexp -m "$@" hydra.sweep.dir=$ROOT/$name 2>&1 \
    | grep -E "^dsexp: (ok|failed)|^[0-9]+ |^job " || true
  pack
}
sweep seed20 script.path=/tmp/seed20/main.py tp=2 'script.fix=[all],[]' $S
sweep seed24 script.path=/tmp/seed24/main.py tp=2,4 check.correctness=false $S
sweep seed24_tp4 script.path=/tmp/seed24/main.py tp=4 check.correctness=false $S
sweep moves script.path=/tmp/moves_first.py tp=2 launcher.gpus=1 'script.fix=[],[host_load,autotp]' timeout_s=200
sweep seed20_tp4 script.path=/tmp/seed20/main.py tp=4 'script.fix=[all]' $S
free -g | head -2; nvidia-smi --query-gpu=memory.used --format=csv
echo "total $(( $(date +%s) - T0 ))s"
