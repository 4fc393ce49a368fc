#!/usr/bin/env bash
# The sizes the code keeps (CI runs this): no function over 60 lines outside the tests (clang-tidy's
# readability-function-size over engine/, train/, models/, kernels/cpu/ and bench/, on a CPU-only
# configuration's compile database), no tracked file over 450 lines (data aside: golden files, images,
# the fuzzers' seeds), and a README of at most 350 lines. Lists every offender and exits 1 if any.
# Usage: scripts/lint.sh [build dir for the compile database, default build-lint]
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-lint}
tidy=$(command -v clang-tidy-14 || command -v clang-tidy || true)
[ -n "$tidy" ] || { echo "lint.sh: clang-tidy not found (scripts/deps.sh installs it)" >&2; exit 1; }
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

# Functions: clang-tidy over the sources outside the tests, two at a time.
if [ ! -f "$build/compile_commands.json" ]; then
  cmake -S . -B "$build" -DDP_CUDA=OFF -DCMAKE_BUILD_TYPE=Release > /dev/null
fi
# (those the database compiles: the CUDA backend is not in a CPU-only one)
mapfile -t sources < <(git ls-files 'engine/*.cpp' 'train/*.cpp' 'models/*.cpp' 'kernels/cpu/*.cpp' 'bench/*.cpp' |
  while read -r f; do grep -q "\"file\": \"$PWD/$f\"" "$build/compile_commands.json" && echo "$f"; done)
config='{Checks: "-*,readability-function-size", CheckOptions: [{key: readability-function-size.LineThreshold, value: 60}]}'
found=$(printf '%s\n' "${sources[@]}" |
  xargs -P 2 -n 8 "$tidy" -p "$build" --quiet --config="$config" 2> /dev/null | grep 'warning: function' || true)
if [ -n "$found" ]; then
  echo "lint.sh: functions over 60 lines:"
  echo "$found" | sed 's/^/  /'
  status=1
fi
[ $status = 0 ] && echo "lint.sh: ${#files[@]} files within 450 lines, README.md $readme lines, ${#sources[@]} sources without a function over 60 lines"
exit $status
