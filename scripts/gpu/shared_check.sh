# Issue 23, first call: does every engine run with its ranks sharing the one H200 (launcher.gpus=1, gloo)?
# Tiny models only (seconds per job), each engine at tp=2 (AutoTP also at 4 and 8, and under the DeepSpeed launcher),
# then the GPU-marked test. What fails here is refused before launch (each engine's shared_gpu_problem, in
# src/dsexp/engines/<name>/__init__.py).
# Usage on the device machine (repo root, `.whl` carried): bash scripts/gpu/shared_check.sh
source scripts/gpu/env.sh
ROOT=/tmp/sweeps/shared_check
mkdir -p $ROOT
sweep() {  # sweep NAME SECONDS OVERRIDES...: one sweep with its own time limit, packed at once
  local name=$1 limit=$2; shift 2
  echo "=== $name: $* ($(date +%T))"
  timeout -s TERM -k 20 "$limit" python3 -m dsexp -m "$@" launcher.gpus=1 timeout_s=240 hydra.sweep.dir=$ROOT/$name 2>&1 \
    | grep -vE "^\[|^ *$|Warning|warn" | tail -15 || true
  for f in $ROOT/$name/*/result.json; do
    [ -f "$f" ] || continue
    python3 - "$f" <<'EOF'
import json, sys
r = json.load(open(sys.argv[1]))
c = r["config"]
f = r.get("failure") or {}
ranks = [x for x in r.get("ranks") or [] if x]
procs = [((x.get("phases") or {}).get("generate") or {}).get("gpu", {}).get("nvml_process_used") for x in ranks]
print(c.get("variant"), c["engine"]["name"], "tp", c["tp"], c["launcher"]["name"], r["status"], f.get("cause"),
      (f.get("message") or "")[:300], "| nvml/proc GiB:", [round(p / 2**30, 2) if p else None for p in procs],
      "| shared:", [x.get("shared_gpu", {}).get("local_rank") for x in ranks])
EOF
  done || true
  tar -czf "$OUT/shared_check.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C /tmp/sweeps shared_check || true
}
sweep autotp 150 experiment=autotp model=internlm2_tiny tp=2,4
sweep autotp8 90 experiment=autotp model=internlm2_tiny tp=8 model.dims.num_key_value_heads=8
sweep autotp_ds 90 experiment=autotp model=internlm2_tiny tp=2 launcher=deepspeed
sweep zero3 120 experiment=zero3 model=tiny tp=2
sweep autotp_zero3 120 experiment=autotp_zero3 model=tiny tp=2
sweep hf_tp 120 experiment=hf_tp model=tiny tp=2
sweep seed_kernel 120 experiment=seed_issue_accepted model=internlm2_tiny tp=2
python3 -m pytest -q -m gpu tests/test_shared_gpu.py -x -p no:cacheprovider 2>&1 | tail -5
sweep inject_llama 240 model=tiny engine.kernel_inject=true engine.injection_policy=null tp=2
echo "total $SECONDS s"
