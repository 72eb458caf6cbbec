#!/usr/bin/env bash
# On the H200: the fragmentation probe (scripts/gpu/fragmentation_probe.py) for llama_20b_shapes at tp=1 under a
# 48 GiB cap, prompt 2048 + 8 new tokens: every batch in one process (default allocator, then expandable segments),
# then the batches at the boundary each in a fresh process. Results under $OUT (default results/h200/fragmentation).
set -u
OUT=${OUT:-results/h200/fragmentation}
mkdir -p "$OUT"
P=scripts/gpu/fragmentation_probe.py
python3 $P --out "$OUT" --batches 1-24 --trace 4,12 2>&1 | tail -30
PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python3 $P --out "$OUT" --batches 1-30 --expandable 2>&1 | tail -32
# the boundary batches, each in a fresh process (a point after an out-of-memory one vs a fresh start)
read -r OK FIRST < <(python3 -c "
import json; r=json.load(open('$OUT/probe_1-24.json'))['points']
ok=[p['batch'] for p in r if p['status']=='ok']; oom=[p['batch'] for p in r if p['status']=='oom']
print(max(ok) if ok else 1, min(oom) if oom else max(ok)+1)")
for B in "$OK" "$FIRST"; do python3 $P --out "$OUT" --batches "$B" 2>&1 | tail -1; done
ls -la "$OUT"
