# Issue 10 on the H200 x2: `make bench` with internlm2_20b_shapes in the writer section (~40 GB written to /tmp).
# Usage on the device machine: bash scripts/gpu/bench.sh   (about 6-8 minutes) -> $OUT/<machine>/bench.{json,md}
source scripts/gpu/env.sh
df -h /tmp | tail -1
python3 benchmarks/run.py --big --out "$OUT" 2>&1 | grep -v "Warning\|warn(" | tail -60
