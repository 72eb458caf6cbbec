# The sampler's cost on the GPU machine (issue 26) and the GPU-marked tests, in one call.
# Usage (repo root, .whlmin carried): WHEELS=.whlmin bash scripts/gpu/probe_costs.sh
#   -> $OUT/sampler_cost.json, $OUT/gpu_tests.{txt,xml}
source scripts/gpu/env.sh
set +e
python3 scripts/gpu/sampler_cost.py > "$OUT/sampler_cost.json" 2> "$OUT/sampler_cost.err"
cat "$OUT/sampler_cost.json"; tail -5 "$OUT/sampler_cost.err"
BUDGET=${BUDGET:-420} bash scripts/gpu/tests.sh
