#!/usr/bin/env bash
# Installs what is missing, builds dp (with the CUDA backend where nvcc exists) and trains LeNet on
# Fashion-MNIST on the default devices. Extra arguments go to dp_train.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build -j "$(nproc)" --target dp_train
exec build/dp_train --batch 256 --epochs 10 "$@"
