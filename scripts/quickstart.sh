#!/usr/bin/env bash
# Installs what is missing, builds dp_train and dp_bench for what this machine can run, and trains
# LeNet on Fashion-MNIST with dp_train's defaults: every GPU, or two simulated devices where there is
# none, nn.DataParallel's strategy (--sync scatter), batch 256, 10 epochs. It ends with the table of
# each device's peak memory by category and bytes per step, and device 0's skew. Arguments go to
# dp_train (--sync allreduce, --epochs 1, --devices 4, ...).
#
# With a GPU (nvidia-smi lists one) and nvcc: the CUDA backend, for that GPU's architecture alone.
# Without one: CPU-only, even where nvcc is installed (the run would use simulated devices anyway, and
# compiling device code for it is most of a CUDA build's time). scripts/test.sh builds and tests the
# CUDA code on every machine with nvcc.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
nvcc_found() { command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }
if nvcc_found && nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then
  echo "quickstart: building dp_train and dp_bench with the CUDA backend, for this machine's GPU"
  flags=(-DDP_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=native)
else
  echo "quickstart: no GPU here: building dp_train and dp_bench CPU-only (simulated devices)"
  flags=(-DDP_CUDA=OFF)
fi
cmake -S . -B build -DCMAKE_BUILD_TYPE=Release "${flags[@]}" > /dev/null
cmake --build build -j "$(nproc)" --target dp_train dp_bench
exec build/dp_train "$@"
