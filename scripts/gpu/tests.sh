# The GPU-marked tests (pytest -m gpu) on the device machine: ranks sharing the GPU (tp=2 over gloo), PyTorch memory
# snapshots, a rank killed on the GPU. Usage (repo root, `.whl` carried): bash scripts/gpu/tests.sh
#   -> $OUT/gpu_tests.txt (pytest's report), $OUT/gpu_tests.xml (JUnit)
source scripts/gpu/env.sh
set +e
export DSEXP_CACHE=/tmp/dsexp-cache-tests
timeout -s TERM -k 20 ${BUDGET:-300} python3 -m pytest -m gpu -p no:cacheprovider -q -rA \
  --junitxml="$OUT/gpu_tests.xml" tests 2>&1 | tail -60 | tee "$OUT/gpu_tests.txt"
