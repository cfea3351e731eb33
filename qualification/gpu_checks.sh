#!/usr/bin/env bash
# The GPU checks in one bounded run on a lent CUDA machine (see qualification/README.md).
#
#   qualification/gpu_checks.sh OUT_DIR
#
# Expects python3 with torch (CUDA) and the project's runtime dependencies importable (on the
# workplace's device machine: wheels carried in .whl/ are installed to /tmp/site first). Runs, each
# under its own time limit so one slow stage cannot eat the others, and tees every log to OUT_DIR:
#   1. pytest -m gpu (bf16 vs f32 parity on CUDA, with and without flash-linear-attention; the
#      qualification stage on CUDA)
#   2. kiln qualify adamw-pytorch-oracle-v1 --device cuda (receipt into OUT_DIR)
#   3. bench_model.py --parity (bf16 logits and LoRA gradients vs transformers + PEFT on CUDA)
#   4. bench_model.py at the real Qwen3.5-4B shape with random weights, T = 4096 (ours, then
#      transformers + PEFT, each under its own limit)
#   5. memory_honesty.py on CUDA (estimate vs torch.cuda.max_memory_allocated)
set -uo pipefail
out=${1:?usage: gpu_checks.sh OUT_DIR}
mkdir -p "$out"
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        || exit 1
    export PYTHONPATH=/tmp/site:$PWD
else
    export PYTHONPATH=$PWD
fi
# STAGES (space-separated names) runs a subset; QUICK=1 runs memory_honesty's short case list.
stage() {  # stage NAME SECONDS CMD...
    local name=$1 limit=$2
    shift 2
    case " ${STAGES:-$name} " in *" $name "*) ;; *) return 0 ;; esac
    echo "=== $name (limit ${limit}s) $(date -u +%T)"
    timeout "$limit" "$@" 2>&1 | tee "$out/$name.log"
    echo "=== $name exit ${PIPESTATUS[0]}"
}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'transformers', transformers.__version__, 'peft', peft.__version__)"
python3 -c "import fla; print('fla', fla.__version__)" || echo "flash-linear-attention not importable"
stage pytest_gpu 130 python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts="-ra" --timeout 100 \
    tests/kiln_train/model/test_qwen35_gpu.py tests/kiln_train/qualify/test_workload.py
stage qualify_cuda 60 python3 -c "from kiln_cli.main import main; main()" \
    qualify adamw-pytorch-oracle-v1 --device cuda --out "$out"
stage bench_parity 60 python3 qualification/bench_model.py --device cuda --parity
# Each side on its own limit: a slow transformers build must not take our figures with it.
stage bench_4b_t4096 120 python3 qualification/bench_model.py --device cuda --preset qwen35-4b-random \
    --lengths 4096 --steps 3 --warmup 1 --rounds 1 --sides ours
stage bench_4b_t4096_transformers 150 python3 qualification/bench_model.py --device cuda \
    --preset qwen35-4b-random --lengths 4096 --steps 3 --warmup 1 --rounds 1 --sides transformers
stage memory_honesty_cuda 130 python3 qualification/memory_honesty.py --device cuda ${QUICK:+--quick}
echo "=== done $(date -u +%T)"
