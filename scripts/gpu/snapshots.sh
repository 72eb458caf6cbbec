# PyTorch memory snapshots on one H200: AutoTP tp=2 at internlm2_20b_shapes, both ranks on the one GPU
# (launcher.gpus=1), the same job with probe.memory_snapshot=false then true, in one call of < 9 minutes.
#   What it reports: the snapshots' cost (job and phase wall times, the time between phases where the dumps happen,
#   each dump's seconds) and their sizes per rank and phase, against the job without them; the memory series and
#   trace.json of both jobs come along (they are on in every job).
#   check.correctness=false: the tp=1 reference would cost another full load; the comparison needs none.
# Usage on the device machine (repo root, `.whl` carried): bash scripts/gpu/snapshots.sh
#   PAIRS=2 runs the pair twice (off, on, off, on); SNAPSHOT_BUDGET (default 500) is the seconds for the sweep.
# Outputs in $OUT (at most 8 files come back, 16 MiB each):
#   snapshots_overhead.md / .json   the comparison (scripts/gpu/snapshots_summary.py)
#   snapshot_summary.json           python -m dsexp.analysis.snapshot_summary: segments, top allocation sites, the history's
#                                   peak, per rank and phase (the pickles are too big to bring back as a rule)
#   h200_snapshots.tar.gz           every result.json, rank record, series file, log and trace.json, the sweep's
#                                   summary.md and plots/ (no pickles, no weights)
#   h200_snapshot_pickles.tar.gz    one job's pickles for pytorch.org/memory_viz, only if the archive fits (15 MiB)
#   snapshots.log                   the run's output
# Afterwards, on CPU:
#   mkdir -p results/h200/snapshots && tar -xzf h200_snapshots.tar.gz -C results/h200/snapshots --strip-components=1
#   python -m dsexp.report results/h200/snapshots --no-mlflow
T0=$(date +%s)
BUDGET=${SNAPSHOT_BUDGET:-500}
PAIRS=${PAIRS:-1}
source scripts/gpu/env.sh
ROOT=/tmp/sweeps/snapshots
rm -rf $ROOT && mkdir -p $ROOT
VARIANTS=$(seq -s, -f 'p%g' 1 "$PAIRS")
M="experiment=autotp model=internlm2_20b_shapes tp=2 launcher.gpus=1 check.correctness=false generate.new_tokens=64 timeout_s=300"
echo "=== snapshots: $M variant=$VARIANTS probe.memory_snapshot=false,true ($(date +%T))" | tee "$OUT/snapshots.log"
timeout -s TERM -k 20 "$BUDGET" python3 -m dsexp -m $M "variant=$VARIANTS" probe.memory_snapshot=false,true \
  hydra.sweep.dir=$ROOT/sweep 2>&1 | tee -a "$OUT/snapshots.log" | grep -E "^dsexp|^[0-9]+ |^job |Error" || true
python3 scripts/gpu/snapshots_summary.py $ROOT/sweep "$OUT/snapshots_overhead" || true
python3 -m dsexp.analysis.snapshot_summary $ROOT/sweep --top 20 --out "$OUT/snapshot_summary.json" || true
tar -czf "$OUT/h200_snapshots.tar.gz" --exclude='*.pt' --exclude='*.safetensors' --exclude='*.pickle' \
  -C "$(dirname $ROOT)" "$(basename $ROOT)" || true
# One job's pickles, when their archive is small enough to come back (else their summary above is what returns).
SNAPS=$(ls -d $ROOT/sweep/*/ranks/snapshots 2>/dev/null | head -1 || true)
if [ -n "$SNAPS" ]; then
  tar -czf "$OUT/h200_snapshot_pickles.tar.gz" -C "$(dirname $SNAPS)" snapshots
  [ "$(du -m "$OUT/h200_snapshot_pickles.tar.gz" | cut -f1)" -le 15 ] || rm "$OUT/h200_snapshot_pickles.tar.gz"
fi
du -sh $ROOT/sweep/*/ranks/snapshots 2>/dev/null || true
echo "total $(( $(date +%s) - T0 ))s"
ls -la "$OUT"
