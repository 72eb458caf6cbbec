# examples/seed_fixed.py (the seed's script with the lines FINDINGS recommends) on one H200 at internlm2_20b_shapes,
# tp=1, next to dsexp's run of the same configuration (experiment=autotp trim=all): the same greedy tokens, and what
# each holds on the GPU. Carry .whl:  run(command="bash scripts/gpu/example.sh", carry=[".whl"])
source scripts/gpu/env.sh
SWEEP=/tmp/sweeps/example
python3 -m dsexp -m experiment=autotp trim=all model=internlm2_20b_shapes tp=1 generate.new_tokens=8 \
  probe.see_memory_usage=false timeout_s=300 hydra.sweep.dir=$SWEEP 2>&1 | grep -E "^dsexp|^[0-9]+ |^job |Error" || true
python3 - "$SWEEP/0/result.json" > "$OUT/dsexp_run.json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
rank = r["ranks"][0]
init = rank["phases"]["init"]
print(json.dumps({"status": r["status"], "tokens": rank.get("generate", {}).get("tokens") or r.get("tokens"),
                  "weights_device_mib": init.get("weights_device", 0) / 2**20, "headline": r.get("headline"),
                  "model_dir": r["runtime"]["model_dir"]}, indent=1))
PY
cat "$OUT/dsexp_run.json"
MODEL=$(python3 -c "import json,sys; print(json.load(open('$OUT/dsexp_run.json'))['model_dir'])")
python3 -m torch.distributed.run --standalone --nproc-per-node=1 examples/seed_fixed.py "$MODEL" 2>&1 \
  | grep -E "^rank|Error|error" | tee "$OUT/example.txt"
