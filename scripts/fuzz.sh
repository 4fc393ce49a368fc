#!/usr/bin/env bash
# Fuzzes the two readers of untrusted files with libFuzzer (+ AddressSanitizer, UBSan): the IDX
# reader (tests/fuzz/fuzz_idx.cpp) and the safetensors checkpoint reader with the model-level checks
# of load_checkpoint (tests/fuzz/fuzz_safetensors.cpp). Builds with clang into build-fuzz, runs each
# fuzzer for a bounded time starting from the seeds in tests/fuzz/corpus/, and exits non-zero on the
# first crash, leak, timeout or sanitizer report; the input that caused it is in build-fuzz/artifacts/.
#
# Usage: scripts/fuzz.sh [seconds per fuzzer]     (default 10; FUZZ_SECONDS works too)
#
# A longer run, e.g. overnight on all cores, keeping what it learns between runs:
#   FUZZ_SECONDS=28800 FUZZ_JOBS=$(nproc) scripts/fuzz.sh
# New inputs accumulate in build-fuzz/corpus-<name>/ (never in the repository). To fold the useful
# ones back into the seeds, minimise:  build-fuzz/fuzz_idx -merge=1 tests/fuzz/corpus/idx build-fuzz/corpus-idx
# Every crash becomes a regression test in tests/test_data.cpp or tests/test_checkpoint.cpp, and its
# input goes into tests/fuzz/corpus/<name>/ as crash-<what>.
set -euo pipefail
cd "$(dirname "$0")/.."
seconds=${1:-${FUZZ_SECONDS:-10}}
jobs=${FUZZ_JOBS:-1}
parallel=()
# libFuzzer's -jobs runs that many fuzzing processes (logs in fuzz-<n>.log); one runs in this process.
[ "$jobs" -gt 1 ] && parallel=(-jobs="$jobs" -workers="$jobs")
CXX=${FUZZ_CXX:-clang++}
command -v "$CXX" > /dev/null || scripts/deps.sh
command -v "$CXX" > /dev/null || { echo "fuzz.sh: $CXX not found (scripts/deps.sh installs clang and libclang-rt-dev)" >&2; exit 1; }

cmake -S . -B build-fuzz -DCMAKE_CXX_COMPILER="$CXX" -DDP_FUZZ=ON -DDP_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo > /dev/null
cmake --build build-fuzz --target fuzz_idx fuzz_safetensors -j 2
mkdir -p build-fuzz/artifacts

export ASAN_OPTIONS=${ASAN_OPTIONS:-detect_leaks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1}
# The two fuzzers side by side (one core each, as the machine has two), then each one's verdict.
fuzz() {  # name
  mkdir -p "build-fuzz/corpus-$1"
  # -max_len: the seeds are tiny and every check is reachable well within 4 KiB.
  build-fuzz/fuzz_$1 -max_total_time="$seconds" -max_len=4096 -timeout=10 -rss_limit_mb=2048 \
    "${parallel[@]}" -print_final_stats=1 -artifact_prefix="build-fuzz/artifacts/$1-" \
    "build-fuzz/corpus-$1" "tests/fuzz/corpus/$1" > "build-fuzz/fuzz_$1.log" 2>&1
}
echo "fuzz_idx, fuzz_safetensors: ${seconds} s each, at once"
declare -A pid
fuzz idx &
pid[idx]=$!
fuzz safetensors &
pid[safetensors]=$!
status=0
for name in idx safetensors; do
  if ! wait "${pid[$name]}"; then
    echo "fuzz_$name FAILED: see build-fuzz/fuzz_$name.log and build-fuzz/artifacts/" >&2
    tail -40 "build-fuzz/fuzz_$name.log" >&2
    status=1
  else
    echo "fuzz_$name: $(grep -E "stat::number_of_executed_units|stat::new_units_added" "build-fuzz/fuzz_$name.log" | tr '\n' ' ')"
  fi
done
exit $status
