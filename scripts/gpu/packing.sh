# Issue 10 on the H200 x2: 4 independent tp=1 jobs (model=small), run one by one and packed onto the 2 GPUs
# (hydra/launcher=dsexp_local launcher.pack=true); wall-time ratio and the largest per-rank difference.
# Usage on the device machine: bash scripts/gpu/packing.sh   (3-4 minutes) -> $OUT/packing.{json,md}, sweeps tarball
source scripts/gpu/env.sh
rc=0
python3 benchmarks/packing.py --jobs 4 --tp 1 --model small --out "$OUT" --keep /tmp/sweeps/packing 2>&1 | tail -25 || rc=$?
bash scripts/gpu/pack.sh /tmp/sweeps/packing/multirun packing_sweeps
exit $rc
