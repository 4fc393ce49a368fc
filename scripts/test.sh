#!/usr/bin/env bash
# Installs what is missing, builds dp CPU-only and (where nvcc exists) with the CUDA backend, and
# runs the test suite on each build. The CUDA build's GPU cases skip visibly on a machine without a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
jobs=$(nproc)

cmake -S . -B build-cpu -DDP_CUDA=OFF -DCMAKE_BUILD_TYPE=Release > /dev/null
cmake --build build-cpu -j "$jobs"
(cd build-cpu && ctest --output-on-failure -j "$jobs")

if command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  cmake -S . -B build-cuda -DDP_CUDA=ON -DCMAKE_BUILD_TYPE=Release > /dev/null
  cmake --build build-cuda -j "$jobs"
  (cd build-cuda && ctest --output-on-failure -j "$jobs")
else
  echo "no nvcc: the CUDA build is skipped"
fi
