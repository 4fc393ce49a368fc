#!/usr/bin/env bash
# Installs what is missing, builds dp and runs the test suite: with the CUDA backend where nvcc
# exists (the configuration that holds everything: the GPU cases run where a GPU is, and skip visibly
# where none is, the rest running on simulated devices as in a CPU-only build), else CPU-only.
# The CPU-only configuration's one difference, the CUDA stub, is built and tested by
# scripts/sanitize.sh (CI runs both); `scripts/test.sh cpu` tests it here too.
#
# Without a GPU the CUDA code is compiled for one architecture only (sm_90): it has to compile and
# link, not run, and a second architecture would double the device code's build for nothing. With a
# GPU, for that GPU (CMake's `native`). The tests' own code at -O1 (DP_TESTS_OPTIONS): what they test
# keeps the release build's -O3 (CMake's Release), their drivers compile faster.
# Usage: scripts/test.sh [cpu|cuda]   (default: cuda where nvcc exists, else cpu)
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/deps.sh
jobs=$(nproc)
nvcc_found() { command -v nvcc > /dev/null || [ -x /usr/local/cuda/bin/nvcc ]; }
what=${1:-$(nvcc_found && echo cuda || echo cpu)}

# ctest in build folder $1. With two at a time a failed test's output lands mid-log; on a failure it is
# printed again, its last 60 lines, after ctest's summary, where the end of a CI log shows it.
run_ctest() {
  local rc=0
  rm -f "$1/readme_flaky.txt"
  (cd "$1" && ctest --output-on-failure -j "$jobs") || rc=$?
  if [ -s "$1/readme_flaky.txt" ]; then  # scripts/readme_figures.sh --check: passed on a second run
    echo "=== scripts/test.sh: README commands that failed once, then passed:"
    cat "$1/readme_flaky.txt"
  fi
  [ $rc = 0 ] && return 0
  echo "=== scripts/test.sh: the failed tests' output again (the last 60 lines of each)"
  awk '/^[0-9]+\/[0-9]+ Testing: / { name = $0; sub(/^[0-9]+\/[0-9]+ Testing: /, "", name); n = 0; next }
       /^Output:$/ && !out { out = 1; getline; next }
       /^<end of output>$/ { out = 0; next }
       out { line[n++] = $0; next }
       /^Test Failed/ { print "--- " name; for (i = n > 60 ? n - 60 : 0; i < n; i++) print line[i] }' \
    "$1/Testing/Temporary/LastTest.log"
  return $rc
}

case "$what" in
  cpu)
    cmake -S . -B build-cpu -DDP_CUDA=OFF -DCMAKE_BUILD_TYPE=Release -DDP_TESTS_OPTIONS=-O1 > /dev/null
    cmake --build build-cpu -j "$jobs"
    run_ctest build-cpu
    ;;
  cuda)
    archs=90
    if nvidia-smi -L 2> /dev/null | grep -q '^GPU'; then archs=native; fi
    echo "CUDA architectures: $archs"
    cmake -S . -B build-cuda -DDP_CUDA=ON -DCMAKE_BUILD_TYPE=Release -DCMAKE_CUDA_ARCHITECTURES="$archs" \
      -DDP_TESTS_OPTIONS=-O1 > /dev/null
    cmake --build build-cuda -j "$jobs"
    run_ctest build-cuda
    ;;
  *)
    echo "usage: scripts/test.sh [cpu|cuda]" >&2
    exit 2
    ;;
esac
