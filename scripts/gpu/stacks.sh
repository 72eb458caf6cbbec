# Issue 15 on one H200: the seed's call at internlm2_20b_shapes on the seed's own stack (transformers 4.42.4 +
# DeepSpeed 0.14.4, an overlay on the machine's torch 2.11) and on today's (transformers 5.17 + DeepSpeed 0.19.8):
#   1. tp=1 on the GPU: the verbatim call (rejected by 0.19.8) and its accepted form on today's stack;
#   2. two CPU-accelerator ranks (device=cpu tp=2): host memory per rank and node after load, on both stacks.
# Carry .whl (dsexp's job environment) and .gpuwheels (the seed stack's cp312 wheels, no torch):
#   run(command="bash scripts/gpu/stacks.sh", carry=[".whl", ".gpuwheels"])
source scripts/gpu/env.sh
M="model=internlm2_20b_shapes timeout_s=400 stack.wheelhouse=$PWD/.gpuwheels/seed check.correctness=false"
sweep() {  # sweep NAME OVERRIDES...: one sweep, packed at once (a call cut short still brings back the others)
  local name=$1; shift
  echo "=== $name: $* ($(date +%T))"
  python3 -m dsexp -m "$@" $M hydra.sweep.dir=/tmp/sweeps/$name 2>&1 | grep -E "^dsexp|^[0-9]+ |^job " || true
  tar -czf "$OUT/$name.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C /tmp/sweeps "$name"
}
python3 -m dsexp.stacks prepare stack=seed stack.wheelhouse=$PWD/.gpuwheels/seed cache_dir=$DSEXP_CACHE | tail -20
sweep gpu_seed experiment=seed_issue stack=seed tp=1 generate.new_tokens=8
sweep gpu_current experiment=seed_issue,seed_issue_accepted stack=current tp=1 generate.new_tokens=8
sweep cpu_seed experiment=seed_issue stack=seed tp=2 device=cpu generate.new_tokens=2
sweep cpu_current experiment=seed_issue_accepted stack=current tp=2 device=cpu generate.new_tokens=2
python3 scripts/gpu/stack_table.py /tmp/sweeps > "$OUT/stacks.md"; cat "$OUT/stacks.md"
df -h /tmp | tail -1; free -g | head -2
