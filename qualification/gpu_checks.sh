#!/usr/bin/env bash
# The GPU checks in one bounded run on a lent CUDA machine (see qualification/README.md,
# docs/kernels.md#benchmark).
#
#   qualification/gpu_checks.sh OUT_DIR
#
# Expects python3 with torch (CUDA) and the project's runtime dependencies importable (on the
# workplace's device machine: wheels carried in .whl/ by qualification/gpu_wheels.sh are installed
# to /tmp/site first). Runs, each under its own time limit so one slow stage cannot eat the others,
# and tees every log to OUT_DIR:
#   1. pytest -m gpu: the Triton kernels compiled for the device (bf16 against the reference, chosen
#      at the 4B widths), bf16 vs f32 parity with and without flash-linear-attention, the
#      qualification stage on CUDA                                                  (~2 min)
#   2. kiln qualify adamw-pytorch-oracle-v1 --device cuda (receipt into OUT_DIR)     (<1 min)
#   3. bench_model.py --parity: bf16 logits and LoRA gradients vs transformers + PEFT (~2-3 min:
#      three configurations, each loading transformers and one model per GDN path)
#   4. gpu_bench.py: the product's step at the 4B shape, T = 4k/16k/32k under 24 and 80 GiB, beside
#      transformers + PEFT; bounded by its own 7-minute limit, every stage inside it
#   5. memory_honesty.py on CUDA (estimate vs torch.cuda.max_memory_allocated; QUICK=1: its short
#      case list, ~2-3 min)
# All five take about 15 minutes: more than one lease of the device machine holds with its start.
# STAGES (space-separated names) runs a subset, e.g. STAGES="pytest_gpu gpu_bench" (~10 minutes).
#
# What runs where: the device machine has torch 2.11 + Triton 3.6. Kiln's Triton kernels run on it;
# flash-linear-attention refuses its gated backward on Hopper below Triton 3.7.1, and Triton 3.7.1's
# wheel (~285 MB) cannot travel in a 64 MiB call, so there the GDN path is torch's and the fla rows
# say why. The worker image (torch 2.13 + Triton 3.7.1, deploy/worker.Dockerfile) runs fla.
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
python3 -m kiln_train.kernels.toolchain || echo "the worker image's GPU kernels would not all run here (above)"
stage pytest_gpu 180 python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts="-ra" --timeout 150 \
    tests/kiln_train/kernels tests/kiln_train/model/test_qwen35_gpu.py tests/kiln_train/qualify/test_workload.py
stage qualify_cuda 90 python3 -c "from kiln_cli.main import main; main()" \
    qualify adamw-pytorch-oracle-v1 --device cuda --out "$out"
stage bench_parity 240 python3 qualification/bench_model.py --device cuda --parity
# gpu_bench bounds its own stages inside a 420 s run limit; the stage limit only catches a hang.
stage gpu_bench 480 python3 qualification/gpu_bench.py --device cuda --scratch /tmp ${PROFILE:+--profile}
stage memory_honesty_cuda 240 python3 qualification/memory_honesty.py --device cuda ${QUICK:+--quick}
echo "=== done $(date -u +%T)"
