#!/usr/bin/env bash
# The figures of README.md and docs/*.md, made by the code they describe. Every figure sits between
#   <!-- figure NAME: COMMAND -->  and  <!-- /figure -->
# in whichever of those files shows it (NAME unique across them), and is the output of COMMAND (a
# shell line, pipes allowed, run from a scratch directory in which build/ is the build directory,
# bench/ the repository's bench/ and docs/ a copy of its docs/*.py, whose PNGs are copied back),
# followed by a line saying when, on what CPU and on which instruction set it was measured. This
# script runs each COMMAND and writes its output back into the file that holds it, so a figure
# cannot drift from the code.
#
#   scripts/readme_figures.sh                 # build, run every figure (~15 min), rewrite the files
#   scripts/readme_figures.sh --only compare  # one figure (--only a,b: several), in whichever file
#   scripts/readme_figures.sh --check         # every dp_train/dp_bench line of the files' ```sh blocks
#                                             # and every figure but those running PyTorch or
#                                             # bench/cpu_speed.sh, at small sizes; files untouched;
#                                             # a failed command runs once more (FLAKY if it passes)
#   scripts/readme_figures.sh [...] FILE.md   # those files only (paths from the repository root)
#
# BUILD=dir picks the build directory (default build/, configured and built here when missing).
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
build=$(realpath -m "${BUILD:-$here/build}")  # absolute: the scratch directory links build/ to it
mode=write only="" files=()
while [ $# -gt 0 ]; do
  case "$1" in
    --check) mode=check ;;
    --only) only=${2:?--only needs a figure name}; shift ;;
    -h | --help) sed -n '2,19p' "$0"; exit 0 ;;
    -*) echo "readme_figures.sh: unknown argument '$1' (accepted: --check, --only NAME, --help, FILE.md ...)" >&2; exit 2 ;;
    *) files+=("$1") ;;
  esac
  shift
done
if [ ${#files[@]} -eq 0 ]; then
  files=(README.md)
  for f in "$here"/docs/*.md; do [ -e "$f" ] && files+=("docs/${f##*/}"); done
fi
for f in "${files[@]}"; do
  [ -f "$here/$f" ] || { echo "readme_figures.sh: no such file: $here/$f" >&2; exit 2; }
done

# Every figure as FILE<tab>NAME<tab>COMMAND; a name twice would make --only ambiguous.
figures_of() { sed -n 's/^<!-- figure \([a-z0-9_-]*\): \(.*\) -->$/\1\t\2/p' "$here/$1" | sed "s|^|$1\t|"; }
mapfile -t figures < <(for f in "${files[@]}"; do figures_of "$f"; done)
dups=$(for fig in "${figures[@]}"; do cut -f2 <<< "$fig"; done | sort | uniq -d | tr '\n' ' ')
[ -z "$dups" ] || { echo "readme_figures.sh: figure names used twice: $dups" >&2; exit 2; }
if [ -n "$only" ]; then
  for name in ${only//,/ }; do
    printf '%s\n' "${figures[@]}" | cut -f2 | grep -qx -- "$name" ||
      { echo "readme_figures.sh: --only $name: no such figure in ${files[*]}" >&2; exit 2; }
  done
fi

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

# Small sizes for --check: every dp_train gets a data subset, every dp_bench compare/comm/bn/scale fewer steps
# and sizes; --plot is dropped where matplotlib is missing (plots are optional).
quick() {
  local line=$1
  line=${line//build\/dp_train/build/dp_train --limit-train 1024 --limit-test 256}
  line=${line//build\/dp_bench compare/build/dp_bench compare --steps 2 --warmup 1 --repeats 2}
  line=${line//build\/dp_bench comm/build/dp_bench comm --max-bytes 64K --iters 4 --repeats 2}
  line=${line//build\/dp_bench bn/build/dp_bench bn --steps 2 --per-device 16,64 --limit-train 1024 --limit-test 256}
  line=${line//build\/dp_bench scale/build/dp_bench scale --steps 2 --warmup 1 --repeats 1}
  line=${line//bench\/scale_processes.sh/bench/scale_processes.sh 1}
  line=${line//bench\/accumulate.sh/bench/accumulate.sh 1 1024}
  line=${line//bench\/grad_dtype.sh/bench/grad_dtype.sh 1 1024}
  /usr/bin/python3 -c "import matplotlib" 2> /dev/null || line=$(sed 's/--plot [^ |;]*//g' <<< "$line")
  echo "$line"
}

# Runs one command line of file $2 in the scratch directory; its output on stdout, failures on stderr.
run_line() {
  local line=$1
  [ "$mode" = check ] && line=$(quick "$line")
  if ! (cd "$scratch" && bash -o pipefail -c "$line" 2>&1); then
    echo "readme_figures.sh: this command of $2 failed: $line" >&2
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
  # Every dp_train / dp_bench line of a ```sh block, and every figure's command, file by file
  # (figures that run PyTorch or the 10-minute CPU comparison are left to their own tests and runs).
  # A command that fails is run once more: one that then passes is reported FLAKY (its first output
  # printed) and written to $build/readme_flaky.txt, which scripts/test.sh prints after the suite, as
  # ctest shows a passing test's output nowhere; one that fails twice fails the check.
  total=0 failed=() flaky=()
  rm -f "$build/readme_flaky.txt"
  for f in "${files[@]}"; do
    mapfile -t lines < <(awk '/^```sh/ {on=1; next} /^```/ {on=0} on && /^build\/dp_/' "$here/$f" |
      sed 's/[[:space:]]*#.*$//'
      figures_of "$f" | cut -f3- | grep -v 'python3\|cpu_speed')
    [ ${#lines[@]} -gt 0 ] || continue
    echo "# $f: ${#lines[@]} command(s)"
    for line in "${lines[@]}"; do
      echo "== $line"
      run_line "$line" "$f" > "$scratch/out.txt" && continue
      cat "$scratch/out.txt"
      echo "readme_figures.sh: running it once more, to tell a flaky command from a broken one" >&2
      if run_line "$line" "$f" > "$scratch/out.txt"; then flaky+=("$f: $line"); else
        cat "$scratch/out.txt"
        failed+=("$f: $line")
      fi
    done
    total=$((total + ${#lines[@]}))
  done
  [ $total -gt 0 ] || { echo "readme_figures.sh: no commands found in ${files[*]}" >&2; exit 1; }
  # scripts/gpu_check.sh reads this line: keep "N README commands run, " at its start. The failed
  # commands are named again last, where a log cut in the middle still shows them.
  if [ ${#flaky[@]} -gt 0 ]; then
    printf 'FLAKY (failed, then passed when run again) %s\n' "${flaky[@]}" | tee "$build/readme_flaky.txt"
  fi
  if [ ${#failed[@]} -eq 0 ]; then
    echo "$total README commands run, all exited 0$([ ${#flaky[@]} = 0 ] || echo " (${#flaky[@]} on a second run)") (${files[*]})"
    exit 0
  fi
  echo "$total README commands run, ${#failed[@]} FAILED (${files[*]}):"
  printf '  FAILED %s\n' "${failed[@]}"
  exit 1
fi

stamp="measured $(machine); simulated devices"
failed=() written=()
for f in "${files[@]}"; do
  tmp=$scratch/page.new ran=0
  cp "$here/$f" "$tmp"
  mapfile -t mine < <(figures_of "$f")
  for fig in "${mine[@]}"; do
    IFS=$'\t' read -r _ name cmd <<< "$fig"
    [ -n "$only" ] && [[ ",$only," != *",$name,"* ]] && continue
    echo "figure $name ($f): $cmd" >&2
    if ! run_line "$cmd" "$f" > "$scratch/$name.out"; then  # the others are still written; the exit says it
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
    ran=$((ran + 1))
  done
  [ $ran -gt 0 ] && { cp "$tmp" "$here/$f"; written+=("$f ($ran)"); }
done
cp "$scratch"/docs/*.png "$here/docs/" 2> /dev/null || true
echo "rewritten: ${written[*]:-nothing}; ${#figures[@]} figure(s) in all$([ -n "$only" ] && echo ", only $only")" >&2
if [ ${#failed[@]} -gt 0 ]; then
  echo "readme_figures.sh: these figures failed and were left as they were: ${failed[*]}" >&2
  exit 1
fi
