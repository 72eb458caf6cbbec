# The AutoTP sweeps of scripts/gpu/shared.sh again (tp=8, 4 and 2 shared, untrimmed and trim=all, the snapshots
# pair), then the sampler's cost (scripts/gpu/sampler_cost.py): after the buffer check moved to the host and the
# sampler's readings were split. Usage (repo root, .whlmin carried): WHEELS=.whlmin bash scripts/gpu/rerun_shared.sh
T0=$(date +%s)
BUDGET=${BUDGET:-500} ONLY="${ONLY:-autotp8 autotp4 autotp2 autotp2_trim}" bash scripts/gpu/shared.sh
source scripts/gpu/env.sh >/dev/null
set +e
timeout 70 python3 scripts/gpu/sampler_cost.py > "$OUT/sampler_cost.json" 2> "$OUT/sampler_cost.err"
tail -3 "$OUT/sampler_cost.err"; echo "rerun total $(( $(date +%s) - T0 ))s"
