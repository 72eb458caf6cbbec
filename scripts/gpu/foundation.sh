# Issue 2 on the H200 x2: llama_20b_shapes at tp=1,2 with nvidia-smi cross-checks, plus checkpoint writer speed.
source scripts/gpu/env.sh
sweep=/tmp/sweeps/foundation
python3 -m dsexp -m model=llama_20b_shapes tp=1,2 probe.nvidia_smi=true hydra.sweep.dir=$sweep 2>&1 | grep -v "INFO\|Warning\|warn(" | tail -25
python3 scripts/gpu/crosscheck.py $sweep > "$OUT/foundation_crosscheck.md"; cat "$OUT/foundation_crosscheck.md"
bash scripts/gpu/pack.sh $sweep foundation
