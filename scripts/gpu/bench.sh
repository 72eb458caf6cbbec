# Issue 10 on the GPU machine: `make bench` (benchmarks/run.py): per-job overhead, sampler cost, cache reuse,
# rank start-up and the checkpoint writer with internlm2_20b_shapes (~40 GB written under /tmp, then removed).
# Usage on the device machine (repo root, `.whl` carried): bash scripts/gpu/bench.sh
#   -> $OUT/<machine>/bench.{json,md} (machine: h200 on one GPU, h200x2 on two), $OUT/bench_sweeps.tar.gz, $OUT/bench.log
# GPU profile (a job costs ~30 s on an H200 even for the tiny model: CUDA, DeepSpeed imports, init): 3 overhead
# jobs, 2 sampler pairs of the tiny model; about 7-8 minutes on one H200 (estimated from the h200x2 run: imports
# ~10 s a repeat, writer ~75 s). bench.json/.md are rewritten after every section, and the benchmark is stopped
# after BENCH_TIMEOUT s (default 520, inside the device tool's 600 s) so that what it measured still comes back
# (SIGTERM reaches the running dsexp job too, which stops its ranks; they run in a session of their own).
# BENCH_ARGS passes options (e.g. BENCH_ARGS="--pairs 2"). Commit $OUT/<machine>/bench.{json,md} as results/<machine>/.
source scripts/gpu/env.sh
df -h /tmp | tail -1
rc=0
timeout -s TERM -k 15 "${BENCH_TIMEOUT:-520}" python3 benchmarks/run.py --out "$OUT" --keep /tmp/bench-sweeps \
  --sampler-model tiny --pairs 2 --overhead-jobs 3 \
  ${BENCH_ARGS:-} > "$OUT/bench.log" 2>&1 || rc=$?
grep -v "Warning\|warn(" "$OUT/bench.log" | tail -80 || true
[ -d /tmp/bench-sweeps/multirun ] && bash scripts/gpu/pack.sh /tmp/bench-sweeps/multirun bench_sweeps
exit $rc
