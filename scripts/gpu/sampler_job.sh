# The sampler's cost at its default period, alone (scripts/gpu/sampler_cost.py) and in real jobs: AutoTP at
# internlm2_20b_shapes, tp=2 on the one GPU, without and with memory snapshots (the snapshots' cost, issue 26).
# Usage (repo root, .whlmin carried): WHEELS=.whlmin bash scripts/gpu/sampler_job.sh
#   -> $OUT/sampler_cost.json, $OUT/shared.tar.gz, snapshots_overhead.{md,json}, snapshot_summary.json
T0=$(date +%s)
source scripts/gpu/env.sh >/dev/null
set +e
timeout 90 python3 scripts/gpu/sampler_cost.py > "$OUT/sampler_cost.json" 2> "$OUT/sampler_cost.err"
tail -3 "$OUT/sampler_cost.err"
python3 -c "import json; d=json.load(open('$OUT/sampler_cost.json')); [print(k, v['core_pct']) for k, v in d['threads'].items()]"
BUDGET=$(( ${BUDGET:-330} - ($(date +%s) - T0) )) ONLY=autotp2 bash scripts/gpu/shared.sh
echo "sampler_job total $(( $(date +%s) - T0 ))s"
