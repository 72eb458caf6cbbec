# Pack a sweep folder for the trip back: one tarball (no logits/checkpoints) + the report outputs.
# Usage: bash scripts/gpu/pack.sh SWEEP_DIR NAME
set -euo pipefail
sweep=$1; name=$2
tar -czf "$OUT/$name.tar.gz" --exclude='*.pt' --exclude='*.safetensors' -C "$(dirname "$sweep")" "$(basename "$sweep")"
ls -la "$OUT"
