# Issue 10 on a machine of 2 or more GPUs: 4 independent tp=1 jobs (model=small), run one by one and packed onto
# the GPUs (hydra/launcher=dsexp_local launcher.pack=true): wall-time ratio and the largest per-rank difference.
# Usage on the device machine (repo root, `.whl` carried): bash scripts/gpu/packing.sh   (3-4 minutes)
#   -> $OUT/packing.{json,md}, $OUT/packing_sweeps.tar.gz, $OUT/packing.log. Commit packing.{json,md} as results/<machine>/.
# Refuses on one GPU: packed jobs need disjoint GPUs, so one GPU cannot show anything about packing.
source scripts/gpu/env.sh
gpus=$(nvidia-smi -L | grep -c "^GPU ")
if [ "$gpus" -lt 2 ]; then
  echo "packing.sh: this machine has $gpus GPU; packing needs at least 2 (ask for kind nvidia-h200-x2)" >&2
  exit 2
fi
rc=0
python3 benchmarks/packing.py --jobs 4 --tp 1 --model small --out "$OUT" --keep /tmp/sweeps/packing \
  > "$OUT/packing.log" 2>&1 || rc=$?
tail -40 "$OUT/packing.log"
[ -d /tmp/sweeps/packing/multirun ] && bash scripts/gpu/pack.sh /tmp/sweeps/packing/multirun packing_sweeps
exit $rc
