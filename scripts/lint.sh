#!/usr/bin/env bash
# The sizes the code keeps (CI runs this): no function over 60 lines outside the tests (clang-tidy's
# readability-function-size over engine/, train/, models/, kernels/cpu/ and bench/, on a CPU-only
# configuration's compile database; and over the CUDA backend, kernels/cuda/ and engine/cuda/, the
# kernels' bodies too, where the toolkit is), no tracked file over 450 lines (data aside: golden files,
# images, the fuzzers' seeds), a README of at most 350 lines, no warning of shellcheck in any tracked
# shell script (sourced files followed); and each target the unity build compiles in batches
# (DP_UNITY) parsed as one unit. Lists every offender and exits 1 if any.
# Usage: scripts/lint.sh [build dir for the compile database, default build-lint]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-lint}
tidy=$(command -v clang-tidy-14 || command -v clang-tidy || true)
[ -n "$tidy" ] || { echo "lint.sh: clang-tidy not found (scripts/deps.sh installs it)" >&2; exit 1; }
command -v shellcheck > /dev/null || { echo "lint.sh: shellcheck not found (scripts/deps.sh installs it)" >&2; exit 1; }
status=0

# Files: every tracked text file but data.
mapfile -t files < <(git ls-files | grep -vE '^tests/golden/|^tests/fuzz/corpus/|\.(png|safetensors)$')
long=$(wc -l "${files[@]}" | awk '$2 != "total" && $1 > 450 {print "  " $2 ": " $1 " lines"}')
if [ -n "$long" ]; then
  echo "lint.sh: files over 450 lines:"
  echo "$long"
  status=1
fi
readme=$(wc -l < README.md)
if [ "$readme" -gt 350 ]; then
  echo "lint.sh: README.md has $readme lines; the guide holds at most 350 (results and details go to docs/)"
  status=1
fi
mapfile -t shells < <(git ls-files '*.sh' .ci/run)
if ! warnings=$(shellcheck -x -S warning "${shells[@]}" 2>&1); then
  echo "lint.sh: shellcheck warnings:"
  echo "$warnings" | sed 's/^/  /'
  status=1
fi

# DP_UNITY=OFF: a unity build's database lists its batches, not the files.
if [ ! -f "$build/compile_commands.json" ]; then
  cmake -S . -B "$build" -DDP_CUDA=OFF -DDP_UNITY=OFF -DCMAKE_BUILD_TYPE=Release > /dev/null
fi
if grep -q '/Unity/unity_' "$build/compile_commands.json"; then
  echo "lint.sh: $build is a unity build, whose database lists batches, not files: configure it with -DDP_UNITY=OFF" >&2
  exit 1
fi
cuda=${CUDA_HOME:-/usr/local/cuda}
mapfile -t cuda_cu < <(git ls-files 'kernels/cuda/*.cu')
mapfile -t cuda_cpp < <(git ls-files 'kernels/cuda/*.cpp' 'engine/cuda/*.cpp')
config='{Checks: "-*,readability-function-size", CheckOptions: [{key: readability-function-size.LineThreshold, value: 60}]}'

# A target's sources in the database, as its unity batches take them: not what CMake generates (the
# precompiled header's entry), not dp_tests' test_main.cpp (compiled alone, without the precompiled header).
# db TARGET files: those sources (absolute paths); db TARGET flags: the first one's compile command without
# its -o and -c, NUL-separated.
db() {
  /usr/bin/python3 -c '
import json, shlex, sys
db, target, what = sys.argv[1:]
for entry in json.load(open(db)):
    file = entry["file"]
    if "/" + target + ".dir/" not in entry["command"] or "/CMakeFiles/" in file or file.endswith("/test_main.cpp"):
        continue
    if what == "files":
        print(file)
        continue
    words, skip = [], False
    for word in shlex.split(entry["command"]):
        if not skip and word not in ("-o", "-c"):
            words.append(word)
        skip = not skip and word in ("-o", "-c")
    sys.stdout.write("\0".join(words) + "\0")
    break
' "$build/compile_commands.json" "$1" "$2"
}

# Each target as one unit: dp_engine, dp_train_app, dp_bench and dp_tests are compiled eight files to a
# translation unit (DP_UNITY), so no two files of one target may declare a name alike at file scope,
# whichever eight come together. Each target's files, as the database lists them, are parsed as one
# unit with the target's flags; where the toolkit is, the CUDA configuration's: engine/cuda/ in place
# of the stub, the tests' CUDA cases compiled in. The three outside the tests are parsed by clang-tidy,
# which checks their functions in the same pass (in the .cpp files the unit includes: --header-filter).
one_unit() {  # target, more flags; its files on stdin: the errors and the functions over 60 lines
  local target=$1 unit flags
  shift
  unit=$(mktemp --suffix=.cpp)
  sed 's|.*|#include "&"|' > "$unit"
  [ -s "$unit" ] || echo "error: no files of $target in $build/compile_commands.json"  # a check of nothing
  mapfile -d '' flags < <(db "$target" flags)
  if [ "$target" = dp_tests ]; then  # the tests: no size to keep, their compiler's parse
    (cd "$build" && "${flags[@]}" "$@" -fsyntax-only "$unit" 2>&1 | grep -E 'error: ' || true)
  else
    (cd "$build" && "$tidy" --quiet --config="$config" --header-filter='\.cpp$' "$unit" -- "${flags[@]:1}" "$@" 2>&1 |
      grep -E 'warning: function|error: ' || true)
  fi
  rm -f "$unit"
}
as_one() {  # the findings, if any
  local with_cuda=() engine_cuda=() stub='^$' half
  if [ -f "$cuda/include/cuda_runtime.h" ]; then
    with_cuda=(-isystem "$cuda/include")
    mapfile -t engine_cuda < <(printf '%s\n' "${cuda_cpp[@]}" | grep '^engine/cuda/' | sed "s|^|$PWD/|")
    stub='/engine/stub/cuda_stub\.cpp$'
  fi
  half=$(mktemp)
  {  # two at a time
    db dp_tests files | one_unit dp_tests "${with_cuda[@]}" ${with_cuda[0]:+-UDP_TESTS_CUDA -DDP_TESTS_CUDA=1}
    { db dp_engine files | grep -v "$stub"; printf '%s\n' "${engine_cuda[@]}"; } | sed '/^$/d' |
      one_unit dp_engine "${with_cuda[@]}"
  } > "$half" &
  db dp_train_app files | one_unit dp_train_app
  db dp_bench files | one_unit dp_bench
  wait $!
  cat "$half"
  rm -f "$half"
}
found=$(as_one)

# Functions: clang-tidy over the other sources outside the tests (those the database compiles: the CUDA
# backend is not in a CPU-only one), file by file, two at a time.
mapfile -t sources < <(git ls-files 'engine/*.cpp' 'train/*.cpp' 'models/*.cpp' 'kernels/cpu/*.cpp' 'bench/*.cpp' |
  while read -r f; do grep -q "\"file\": \"$PWD/$f\"" "$build/compile_commands.json" && echo "$f"; done)
mapfile -t in_units < <(for t in dp_engine dp_train_app dp_bench; do db $t files; done | sed "s|^$PWD/||")
found+=$(printf '\n%s' "$(printf '%s\n' "${sources[@]}" | grep -vxF -f <(printf '%s\n' "${in_units[@]}") |
  xargs -P 2 -n 8 "$tidy" -p "$build" --quiet --config="$config" 2> /dev/null | grep 'warning: function' || true)")

# The CUDA backend, which no CPU-only database compiles and whose nvcc commands clang does not take:
# each file on a command line of its own, .cu as CUDA host code (clang parses the kernels' bodies there
# too), .cpp as C++ (engine/cuda/'s in dp_engine's unit above). clang 14 knows CUDA up to 11.5: its CUDA
# wrapper includes texture headers that CUDA 12 removed, so its texture intrinsics' guard is defined and
# an empty texture_fetch_functions.h stands in. A file that does not parse fails the lint, since a check
# of nothing would pass.
cuda_functions() {  # the findings, or "parse error" lines
  local stub
  stub=$(mktemp -d)
  : > "$stub/texture_fetch_functions.h"
  local common=(-std=c++20 -I. -isystem "$cuda/include")
  local cu=(-x cuda --cuda-host-only --cuda-path="$cuda" -nocudalib --no-cuda-version-check
    -D__CLANG_CUDA_TEXTURE_INTRINSICS_H__ -isystem "$stub")
  {
    printf '%s\n' "${cuda_cu[@]}" | xargs -P 2 -I{} "$tidy" --quiet --config="$config" {} -- "${cu[@]}" "${common[@]}"
    printf '%s\n' "${cuda_cpp[@]}" | grep -v '^engine/cuda/' |
      xargs -P 2 -I{} "$tidy" --quiet --config="$config" {} -- -x c++ "${common[@]}"
  } 2>&1 | grep -E 'warning: function|error: ' | sed '/error: /s/^/parse error: /' || true
  rm -rf "$stub"
}
cuda_sources=0
if [ -f "$cuda/include/cuda_runtime.h" ]; then
  cuda_sources=$((${#cuda_cu[@]} + ${#cuda_cpp[@]}))
  found+=$(printf '\n%s' "$(cuda_functions)")
else
  echo "lint.sh: no CUDA toolkit at $cuda (CUDA_HOME): kernels/cuda/ and engine/cuda/ not checked for function size"
fi
found=$(echo "$found" | sed '/^$/d')
if [ -n "$found" ]; then
  echo "lint.sh: functions over 60 lines, or errors: a target's files that do not compile as one unit (a name"
  echo "declared alike in two of them?), CUDA sources that did not parse:"
  echo "$found" | sed 's/^/  /'
  status=1
fi
[ $status = 0 ] && echo "lint.sh: ${#files[@]} files within 450 lines, README.md $readme lines, ${#shells[@]} shell scripts without a shellcheck warning, $((${#sources[@]} + cuda_sources)) sources without a function over 60 lines, each unity target one unit"
exit $status
