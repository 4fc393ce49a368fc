#!/usr/bin/env bash
# Installs what is missing, builds dp (with the CUDA backend where nvcc exists) and trains LeNet on
# Fashion-MNIST with dp_train's defaults: every GPU, or two simulated devices where there is none,
# nn.DataParallel's strategy (--sync scatter), batch 256, 10 epochs. It ends with the table of
# each device's peak memory by category and bytes per step, and device 0's skew. Arguments go to
# dp_train (--sync allreduce, --epochs 1, --devices 4, ...).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)" --target dp_train dp_bench
exec build/dp_train "$@"
