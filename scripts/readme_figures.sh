#!/usr/bin/env bash
# The README's figures, made by the code they describe. Every figure in README.md sits between
#   <!-- figure NAME: COMMAND -->  and  <!-- /figure -->
# and is the output of COMMAND (a shell line, pipes allowed, run from a scratch directory in which
# build/ is the build directory and docs/ the repository's docs/), followed by a line saying when,
# on what CPU and on which instruction set it was measured. This script runs each COMMAND and
# writes its output back, so a figure cannot drift from the code.
#
#   scripts/readme_figures.sh                 # build, run every figure (~15 min), rewrite README.md
#   scripts/readme_figures.sh --only compare  # one figure (--only a,b: several)
#   scripts/readme_figures.sh --check         # every dp_train/dp_bench line of the README's shell
#                                             # blocks and figures, at small sizes; README untouched
#
# BUILD=dir picks the build directory (default build/, configured and built here when missing).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
readme=$here/README.md
mode=write only=""
while [ $# -gt 0 ]; do
  case "$1" in
    --check) mode=check ;;
    --only) only=${2:?--only needs a figure name}; shift ;;
    -h | --help) sed -n '2,15p' "$0"; exit 0 ;;
    *) echo "readme_figures.sh: unknown argument '$1' (accepted: --check, --only NAME, --help)" >&2; exit 2 ;;
  esac
  shift
done

if [ ! -x "$build/dp_train" ] || [ ! -x "$build/dp_bench" ]; then
  cmake -S "$here" -B "$build" -DCMAKE_BUILD_TYPE=Release > /dev/null
  cmake --build "$build" -j "$(nproc)" --target dp_train dp_bench > /dev/null
fi
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
ln -s "$build" "$scratch/build"
ln -s "$here/bench" "$scratch/bench"
mkdir "$scratch/docs"
cp "$here"/docs/*.py "$scratch/docs/"

# Small sizes for --check: every dp_train gets a data subset, every dp_bench compare/comm/bn fewer steps
# and sizes; --plot is dropped where matplotlib is missing (plots are optional).
quick() {
  local line=$1
  line=${line//build\/dp_train/build/dp_train --limit-train 1024 --limit-test 256}
  line=${line//build\/dp_bench compare/build/dp_bench compare --steps 2 --warmup 1 --repeats 2}
  line=${line//build\/dp_bench comm/build/dp_bench comm --max-bytes 64K --iters 4 --repeats 2}
  line=${line//build\/dp_bench bn/build/dp_bench bn --steps 2 --per-device 16,64 --limit-train 1024 --limit-test 256}
  /usr/bin/python3 -c "import matplotlib" 2> /dev/null || line=$(sed 's/--plot [^ |;]*//g' <<< "$line")
  echo "$line"
}

# Runs one command line in the scratch directory; its output on stdout, failures named on stderr.
run_line() {
  local line=$1
  [ "$mode" = check ] && line=$(quick "$line")
  if ! (cd "$scratch" && bash -o pipefail -c "$line" 2>&1); then
    echo "readme_figures.sh: this README command failed: $line" >&2
    return 1
  fi
}

machine() {
  local cpu isa=AVX2
  cpu=$(sed -n 's/^model name[[:space:]]*: //p' /proc/cpuinfo | head -1)
  grep -q avx512f /proc/cpuinfo && isa="AVX-512" || isa="AVX2, no AVX-512"
  echo "$(date -u +%Y-%m-%d), $cpu, $(nproc) cores, $isa"
}

if [ "$mode" = check ]; then
  # Every dp_train / dp_bench line of a ```sh block, and every figure's command.
  # (figures that run PyTorch or the 10-minute CPU comparison are left to their own tests and runs).
  mapfile -t lines < <(awk '/^```sh/ {on=1; next} /^```/ {on=0} on && /^build\/dp_/' "$readme" |
    sed 's/[[:space:]]*#.*$//'
    sed -n 's/^<!-- figure [a-z0-9_-]*: \(.*\) -->$/\1/p' "$readme" | grep -v 'python3\|cpu_speed')
  [ ${#lines[@]} -gt 0 ] || { echo "readme_figures.sh: no commands found in $readme" >&2; exit 1; }
  failed=0
  for line in "${lines[@]}"; do
    echo "== $line"
    run_line "$line" > "$scratch/out.txt" || { cat "$scratch/out.txt"; failed=1; }
  done
  echo "${#lines[@]} README commands run, $([ $failed = 0 ] && echo "all exited 0" || echo "some FAILED")"
  exit $failed
fi

stamp="measured $(machine); simulated devices"
failed=()
tmp=$scratch/README.new
cp "$readme" "$tmp"
mapfile -t figures < <(sed -n 's/^<!-- figure \([a-z0-9_-]*\): \(.*\) -->$/\1\t\2/p' "$readme")
for fig in "${figures[@]}"; do
  name=${fig%%$'\t'*} cmd=${fig#*$'\t'}
  [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
  echo "figure $name: $cmd" >&2
  if ! run_line "$cmd" > "$scratch/$name.out"; then  # the others are still written; the exit says it
    cat "$scratch/$name.out" >&2
    failed+=("$name")
    continue
  fi
  load=$(cut -d' ' -f1 /proc/loadavg)  # other work on the machine makes the times loose: say how much
  { echo '```text'; cat "$scratch/$name.out"; echo '```'; echo "<sub>\$ $cmd — $stamp; load average $load at the end</sub>"; } > "$scratch/$name.block"
  awk -v name="$name" -v block="$scratch/$name.block" '
    $0 ~ "^<!-- figure " name ": " { print; while ((getline l < block) > 0) print l; skip = 1; next }
    skip && /^<!-- \/figure -->$/ { skip = 0 }
    !skip' "$tmp" > "$tmp.1"
  mv "$tmp.1" "$tmp"
done
cp "$scratch"/docs/*.png "$here/docs/" 2> /dev/null || true
cp "$tmp" "$readme"
echo "README.md rewritten: ${#figures[@]} figure(s)$([ -n "$only" ] && echo " (only $only)")" >&2
if [ ${#failed[@]} -gt 0 ]; then
  echo "readme_figures.sh: these figures failed and were left as they were: ${failed[*]}" >&2
  exit 1
fi
