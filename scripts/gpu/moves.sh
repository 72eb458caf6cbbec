# Issue 24/25 on the one-H200 machine: a script that moves the model to the GPU (.cuda()) before init_inference,
# with kernel injection for a layer DeepSpeed has no policy for, on tiny InternLM2 as published (its rotary buffers
# are left uninitialised by transformers 5.17): fixed by restore_buffers alone and with host_load + autotp, its
# ranks sharing the GPU (tp=2). As written it was measured in results/h200/scripts/moves. Then, time left, the
# snapshot GPU test. Usage (repo root, `.whl` carried): bash scripts/gpu/moves.sh
T0=$(date +%s)
BUDGET=${BUDGET:-240}
source scripts/gpu/env.sh
set +e
ROOT=/tmp/sweeps/scripts
mkdir -p $ROOT /tmp/moves
DT=$(python3 scripts/gpu/model_dir.py model=internlm2_tiny cache_dir=$DSEXP_CACHE | tail -1)
python3 -c "import sys; sys.path.insert(0, 'tests'); from helpers.user_scripts import write_script; write_script('/tmp/moves', 'moves_first.py', '$DT')"
timeout -s TERM -k 10 $(( BUDGET - ($(date +%s) - T0) )) python3 -m dsexp -m script.path=/tmp/moves/moves_first.py tp=2 \
  launcher.gpus=1 'script.fix=[restore_buffers],[host_load,autotp,restore_buffers]' timeout_s=150 \
  hydra.sweep.dir=$ROOT/moves_fixed 2>&1 | grep -E "^dsexp: (ok|failed)|^[0-9]+ |^job " || true
tar -czf "$OUT/moves.tar.gz" --exclude='*.pickle' -C $ROOT moves_fixed || true
cp $ROOT/moves_fixed/summary.md "$OUT/summary_moves_fixed.md" 2>/dev/null || true
LEFT=$(( BUDGET + ${TEST_BUDGET:-150} - ($(date +%s) - T0) ))
echo "moves done at $(( $(date +%s) - T0 ))s; ${LEFT}s for the snapshot test"
if [ "$LEFT" -gt 60 ]; then
  DSEXP_CACHE=/tmp/dsexp-cache-tests timeout -s TERM -k 10 $LEFT python3 -m pytest -m gpu -p no:cacheprovider -q -rA \
    tests/test_snapshots.py 2>&1 | tail -15 | tee "$OUT/gpu_snapshot_test.txt"
fi
echo "total $(( $(date +%s) - T0 ))s"
