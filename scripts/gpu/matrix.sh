# Issue 6 on the H200 x2: the seed and the fix matrix at InternLM2-20B shapes, in two calls of < 10 minutes.
# Usage on the device machine: bash scripts/gpu/matrix.sh 1   (then, while the machine is still warm: ... 2)
# Every sweep gets its own folder under /tmp/sweeps; all are packed into $OUT/h200x2_stage<N>.tar.gz and the
# report is rebuilt from the result.json files on the way back (python -m dsexp.report).
source scripts/gpu/env.sh
M="model=internlm2_20b_shapes probe.nvidia_smi=true timeout_s=300"
sweep() {  # sweep NAME OVERRIDES...
  local name=$1; shift
  echo "=== $name: $* ($(date +%T))"
  python3 -m dsexp -m "$@" $M hydra.sweep.dir=/tmp/sweeps/$name 2>&1 | grep -E "^dsexp|^[0-9]+ |^job " || true
}
case "$1" in
1)
  sweep seed_issue experiment=seed_issue tp=1,2
  sweep seed_issue_accepted experiment=seed_issue_accepted tp=1,2
  sweep autotp_eager_meta experiment=autotp tp=2 load=eager,meta dtype=bf16,fp16
  ;;
2)
  sweep autotp_sharded_bf16 experiment=autotp tp=2 load=sharded dtype=bf16
  rm -rf "$DSEXP_CACHE/shards"   # disk: each tp=2 split is another 37 GiB
  sweep autotp_sharded_fp16 experiment=autotp tp=2 load=sharded dtype=fp16
  rm -rf "$DSEXP_CACHE/shards"
  sweep engines experiment=zero3,zero3_offload,hf_tp,autotp_zero3 tp=2
  ;;
esac
df -h /tmp | tail -1
tar -czf "$OUT/h200x2_stage$1.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C /tmp/sweeps .
ls -la "$OUT"
