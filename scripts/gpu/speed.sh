# Issue 10 (and issue 8's GPU teardown check) on the H200 x2, in two calls of < 10 minutes.
# Usage on the device machine:  bash scripts/gpu/speed.sh 1   (then: bash scripts/gpu/speed.sh 2)
#   1: GPU fault tests (CUDA OOM, SIGKILL; device memory back to baseline), packing (4 tp=1 jobs packed vs
#      sequential on 2 GPUs), bench sections imports + writer (with internlm2_20b_shapes, ~40 GB)
#   2: bench sections overhead + sampler, merged into the committed results/<machine>/bench.json of call 1
source scripts/gpu/env.sh
case "$1" in
1)
  python3 -m pytest -q -m gpu -p no:cacheprovider --basetemp=/tmp/pt tests/test_faults_gpu.py 2>&1 | tail -15 | tee "$OUT/gpu_faults.txt" || true
  tar -czf "$OUT/gpu_faults.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C /tmp/pt . || true
  python3 benchmarks/packing.py --jobs 4 --tp 1 --model small --out "$OUT" --keep /tmp/sweeps/packing 2>&1 | tail -25 || true
  tar -czf "$OUT/packing_sweeps.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C /tmp/sweeps/packing multirun || true
  python3 benchmarks/run.py --big --only imports,writer --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tail -20
  ;;
2)
  python3 benchmarks/run.py --only overhead,sampler --out results 2>&1 | grep -v "Warning\|warn(" | tail -40
  mkdir -p "$OUT/bench" && cp results/h200x*/bench.* "$OUT/bench/"; ls -la "$OUT/bench"
  ;;
esac
