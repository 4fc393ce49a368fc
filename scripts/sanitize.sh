#!/usr/bin/env bash
# Builds the CPU configuration with sanitizers and runs the tests under them:
#   build-asan: -fsanitize=address,undefined (the two SIMD kernel units ASan alone: CMakeLists.txt),
#               the whole suite (dp_train and dp_bench, which the CLI, resume and signal tests start,
#               are instrumented too) but the README check, which runs
#               on the full data set what the suite runs on small synthetic sets. The tests' own
#               sources are built without UBSan (DP_TESTS_NO_SANITIZE) and at -O0 (DP_TESTS_OPTIONS):
#               UBSan doubled their compile time and -O1 added half again, while the code they test
#               keeps both (-O1, as the sanitizers recommend);
#   build-tsan: -fsanitize=thread, built from the test files that exercise the threads alone
#               (DP_TESTS_ONLY): the engine, prefetch, collectives, strategies, BatchNorm across
#               replicas, faults, resume, signals, the trace (spans stamped on the communication
#               thread), the loader thread, the waits, BLIS under device threads, and dp_train end to
#               end; the kernel, gradient-check, golden and parser suites are single-threaded
#               arithmetic (slow under TSan), and dp_bench, whose own code drives the same engine and
#               communicator from one thread, is not built here.
# The tests see they are sanitized (tests/util.h's kSanitized) and thin what only repeats the same code
# on other numbers: the equal-results matrices run 3 devices alone and the resume chains check their
# stop and end but not every step between; the plain builds (scripts/test.sh) run them whole.
# Any report fails the run. Usage: scripts/sanitize.sh [asan|tsan]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
jobs=2  # the CI machine has 2 cores; the sanitizer builds are memory-hungry too
cxx=${SANITIZE_CXX:-clang++}
command -v "$cxx" > /dev/null || scripts/deps.sh

# A sanitizer report in a dp_train started by a test exits 86, which no test expects.
# allocator_may_return_null: an allocation that cannot be had returns null, as without a sanitizer, so
# that the tests of what dp does then (a simulated device's failed host allocation) run here too.
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=0:exitcode=86:detect_leaks=1:strict_string_checks=1:allocator_may_return_null=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:exitcode=86}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:exitcode=86:second_deadlock_stack=1:allocator_may_return_null=1:suppressions=$PWD/tests/tsan.supp}

build() {  # build dir, sanitizer list, more cmake arguments
  # -O1: the sanitizers' own recommendation, and half the compile time of -O2 with their instrumentation.
  # DP_MPI=OFF: OpenMPI is not built with the sanitizers (ASan needs dlclose off and LSan suppressions for
  # it, TSan sees its uninstrumented threads race); the mpi: tests then say they are skipped. Not done.
  # clang: its sanitizers are the reference ones, and here it built the ASan configuration in half
  # gcc's time and its instrumented suite ran in half the time too (85 s against 167 s, 2 cores).
  cmake -S . -B "$1" -DCMAKE_CXX_COMPILER="$cxx" -DDP_CUDA=OFF -DDP_MPI=OFF -DCMAKE_BUILD_TYPE=Release \
    -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" -DDP_SANITIZE="$2" "${@:3}" > /dev/null
  cmake --build "$1" -j "$jobs" --target dp_train dp_tests
}

threaded="test_engine;test_prefetch;test_collectives;test_naive;test_batchnorm;test_resume;test_signals;test_trace"
threaded+=";test_loader;test_wait;test_blas;test_cli;test_outputs"

if [ "$what" = all ] || [ "$what" = asan ]; then
  build build-asan address,undefined -DDP_TESTS_NO_SANITIZE=undefined -DDP_TESTS_OPTIONS=-O0
  (cd build-asan && ctest --output-on-failure -j "$jobs" --timeout 900 -E '^readme:')
fi

if [ "$what" = all ] || [ "$what" = tsan ]; then
  build build-tsan thread -DDP_TESTS_ONLY="$threaded" -DDP_TESTS_OPTIONS=-O0
  # BLIS runs on the calling thread (the serial build; one thread per simulated device), so its
  # internals stay off the report; tests/tsan.supp lists what is suppressed and why.
  (cd build-tsan && ctest --output-on-failure -j "$jobs" --timeout 900 -E '^readme:')
fi
