# Issue 45's H200 steps of campaigns/budget.yaml, a few a device call (each call's files come back as two archives:
# at most 8 files return). Usage on the GPU machine, repo root, `.whl` carried:
#   bash scripts/gpu/budget_one_load.sh gpu40_one_load[,gpu24_one_load,...]
set -o pipefail
source scripts/gpu/env.sh > /dev/null
set +e  # env.sh sets -e: a step that fails must still send back what it wrote
mkdir -p /tmp/res
python -m dsexp.campaign budget --only "$1" --out /tmp/res 2>&1 | tee /tmp/res/campaign_"${1//,/_}".log | tail -60
tar czf "$OUT/res.tgz" -C /tmp/res .
find /tmp/campaigns -name "*.log" -size -2M | tar czf "$OUT/logs.tgz" -T - 2>/dev/null
ls -la "$OUT"
