# A GPU machine without network: install the carried wheels and set the environment (docs/gpu.md).
# Usage (repo root, `.whl` copied with the tree): source scripts/gpu/env.sh; then e.g. python -m dsexp.campaign example
# `.whl` holds the wheels dsexp's job environment needs and the machine's image lacks (DeepSpeed, hydra-core,
# omegaconf, mlflow-skinny, pydantic and what they import; the list: JOB_WHEELS in src/dsexp/job/overlay.py). Fill
# it beforehand on a machine that reaches PyPI, from the repo root (it is git-ignored):
#   .venv/bin/python -m dsexp.stacks fill-job .whl --python-version 3.12
# Sourced, it leaves the caller's shell options as they were (no `set -e` here): a failed step returns 1 from
# `source`, with a line saying which, and sets nothing after it.
_dsexp_gpu_env() {
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        "${WHEELS:-.whl}"/*.whl || { echo "env.sh: installing the wheels in ${WHEELS:-.whl} failed" >&2; return 1; }
    export PYTHONPATH=/tmp/site:$PWD/src PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
    export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    export DSEXP_CACHE=/tmp/dsexp-cache MLFLOW_TRACKING_URI=sqlite:////tmp/dsexp-mlflow.db DSEXP_CAMPAIGN_WORK=/tmp/campaigns
    export OUT=${OUT:-/tmp/out}
    mkdir -p "$OUT" || return 1
    nvidia-smi --query-gpu=index,name,memory.used,memory.total --format=csv >"$OUT/gpus.csv" \
        || { echo "env.sh: nvidia-smi failed: no GPU visible" >&2; return 1; }
    cat "$OUT/gpus.csv"
    python3 -c 'import torch, transformers, deepspeed, hydra; print("torch", torch.__version__, "cuda", torch.cuda.device_count(), "transformers", transformers.__version__, "deepspeed", deepspeed.__version__)' 2>&1 | tail -1
    # MLflow is carried in .whl (a folder without it, WHEELS=...: jobs then track nothing)
    python3 -c 'import mlflow; print("mlflow", mlflow.__version__)' 2>/dev/null || echo "mlflow: not installed (no tracking)"
}
_dsexp_gpu_env
_dsexp_status=$?
unset -f _dsexp_gpu_env
return "$_dsexp_status" 2>/dev/null || exit "$_dsexp_status"  # `return` when sourced, `exit` when run
