#!/usr/bin/env bash
# Builds the CPU configuration with sanitizers and runs the tests under them:
#   build-asan: -fsanitize=address,undefined, the whole suite (dp_train and dp_bench, which the CLI,
#               resume and signal tests start, are instrumented too) but the README check, which runs
#               on the full data set what the suite runs on small synthetic sets. The tests' own
#               sources are built without UBSan (DP_TESTS_NO_SANITIZE): it doubled their compile time,
#               and the code they test keeps it;
#   build-tsan: -fsanitize=thread, the tests that exercise the threads: engine, collectives, faults,
#               resume, signals, the trace (spans stamped on the communication thread), the
#               loader thread and the simulated devices' copy thread (prefetch); the kernel,
#               gradcheck and golden suites are single-threaded arithmetic and slow under TSan.
# Any report fails the run. Usage: scripts/sanitize.sh [asan|tsan]   (default: both)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
jobs=2  # the CI machine has 2 cores; the sanitizer builds are memory-hungry too

# A sanitizer report in a dp_train started by a test exits 86, which no test expects.
export ASAN_OPTIONS=${ASAN_OPTIONS:-halt_on_error=1:abort_on_error=0:exitcode=86:detect_leaks=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-halt_on_error=1:print_stacktrace=1:exitcode=86}
export TSAN_OPTIONS=${TSAN_OPTIONS:-halt_on_error=1:exitcode=86:second_deadlock_stack=1:suppressions=$PWD/tests/tsan.supp}

build() {  # build dir, sanitizer list, more cmake arguments
  # -O1: the sanitizers' own recommendation, and half the compile time of -O2 with their instrumentation.
  # DP_MPI=OFF: OpenMPI is not built with the sanitizers (ASan needs dlclose off and LSan suppressions for
  # it, TSan sees its uninstrumented threads race); the mpi: tests then say they are skipped. Not done.
  cmake -S . -B "$1" -DDP_CUDA=OFF -DDP_MPI=OFF -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_FLAGS_RELEASE="-O1 -DNDEBUG" -DDP_SANITIZE="$2" "${@:3}" > /dev/null
  cmake --build "$1" -j "$jobs" --target dp_train dp_tests
}

if [ "$what" = all ] || [ "$what" = asan ]; then
  build build-asan address,undefined -DDP_TESTS_NO_SANITIZE=undefined
  (cd build-asan && ctest --output-on-failure -j "$jobs" --timeout 900 -E '^readme:')
fi

if [ "$what" = all ] || [ "$what" = tsan ]; then
  build build-tsan thread
  # BLIS runs on the calling thread (the serial build; one thread per simulated device), so its
  # internals stay off the report; tests/tsan.supp lists what is suppressed and why.
  # Through ctest, so the 85 cases run two at a time.
  (cd build-tsan && ctest --output-on-failure -j "$jobs" --timeout 900 -E '^readme:' \
    -R 'strateg|replica|bytes per step|fault|device-memory|batch smaller|ledger|all_reduce|broadcast|aborted|even_chunks|resume|SIGINT|killed|diverging|dp_train|^blas:|^signals|^trace:|^loader:|^prefetch:|^wait:')
fi
