#!/usr/bin/env bash
# Formats every C++ and CUDA file of the repository with clang-format 14 and the project's
# .clang-format. With --check it changes nothing and fails, listing the files, when one is not
# formatted (CI runs that).
# Usage: scripts/format.sh [--check]
set -euo pipefail
cd "$(dirname "$0")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
[ -n "$fmt" ] || { echo "format.sh: clang-format not found (scripts/deps.sh installs it)" >&2; exit 1; }
# Another major version formats differently: the check would fail on files that are fine.
"$fmt" --version | grep -q "version 14\." || { echo "format.sh: $fmt is not clang-format 14: $("$fmt" --version)" >&2; exit 1; }
mapfile -t files < <(git ls-files '*.h' '*.cpp' '*.cu' '*.cuh')
if [ "${1:-}" = "--check" ]; then
  bad=()
  for f in "${files[@]}"; do "$fmt" --dry-run -Werror "$f" > /dev/null 2>&1 || bad+=("$f"); done
  if [ ${#bad[@]} -gt 0 ]; then
    echo "format.sh: not formatted (run scripts/format.sh): ${bad[*]}" >&2
    exit 1
  fi
  echo "format.sh: ${#files[@]} files formatted"
else
  "$fmt" -i "${files[@]}"
fi
