#!/usr/bin/env bash
# The first run of dp on a real GPU, in one command, on a machine without our Debian packages and
# without network (one H100/H200, CUDA 13 under /usr/local/cuda, CMake, ninja, PyTorch with its cuDNN
# and NCCL wheels). Run it there after scripts/gpu_kit.sh made the kit on a Debian machine and the kit
# was copied into the repository's root (relative paths below are taken from that root):
#
#   scripts/gpu_check.sh [--kit DIR] [--out DIR] [--build DIR] [--tar FILE] [--only a,b] [--skip a,b]
#                        [--epochs N] [--jobs N] [--arch SM] [--no-link-data] [--cpu-dry-run]
#
# Steps (names for --only/--skip), each logged to OUT/NN-step.log; a failed step does not stop the next:
#   env       versions of the driver, GPU, nvcc, cmake, ninja, compiler, PyTorch, cuDNN, NCCL; the kit
#   configure cmake -DDP_CUDA=ON for this GPU's architecture, BLIS/zlib/doctest/CLI11/nlohmann-json from
#             the kit (CMAKE_PREFIX_PATH), cuDNN and NCCL from /usr/local/cuda or PyTorch's wheels
#   build     ninja, every target
#   ctest     the test suite but the README check; fails if the "cuda: GPU cases" entry is Skipped or a
#             test says "CUDA case skipped" (a fallback to simulated devices)
#   readme    the README check (every build/dp_* line of README.md and docs/*.md at small sizes)
#   train     dp_train --backend cuda --gpus 0, N epochs on the kit's Fashion-MNIST
#   prefetch  dp_train --gpus 0 --steps 2000 with and without --no-prefetch, 3 alternated rounds:
#             images/s and the load phase (ms a step), the copy stream's gain
#   verify-scatter, verify-allreduce
#             dp_train --backend cuda --gpus 0,0 --allow-shared-device --verify --steps 20
#   compare, skew, comm
#             dp_bench on --gpus 0,0 --allow-shared-device --backend cuda
#   torch     PyTorch eager training the same LeNet at the same batch and epochs on the same GPU
# No step runs NCCL across processes (mpirun -np 2 dp_train --gpus ...): on one GPU the two processes
# would share it, and NCCL refuses one GPU twice in a communicator (dp says so before NCCL starts).
# then a summary table (step, exit code, seconds, key number) in OUT/summary.txt; the exit code is 1
# if any step failed, 2 if the machine cannot run the check at all (no nvidia-smi, nvcc or kit).
#
# --cpu-dry-run runs the same steps on a machine without a GPU (CPU-only build, --backend cpu, small
# sizes, the GPU entry expected Skipped), so the script's own logic can be tested anywhere.
# --tar FILE also packs OUT into FILE (the device tool brings back at most 8 files).
# README commands and dp_train's default --data read /usr/share/datasets/fashion-mnist: where it is
# absent (the GPU machine), it is linked to the kit's copy, and the run says so (--no-link-data: not).
# Defaults: --kit gpu-kit, --out gpu-check-out, --build build-gpu (build-gpu-dry for a dry run),
# --epochs 10, --jobs: every core (2 in a dry run), --arch: nvidia-smi's compute capability.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 2

kit=gpu-kit out=gpu-check-out build="" tarball="" only="" skip="" epochs=10 jobs="" arch="" dry=0 link_data=1
usage() { sed -n '2,37p' "$0"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --kit) kit=${2:?--kit needs a directory}; shift ;;
    --out) out=${2:?--out needs a directory}; shift ;;
    --build) build=${2:?--build needs a directory}; shift ;;
    --tar) tarball=${2:?--tar needs a file name}; shift ;;
    --only) only=${2:?--only needs step names}; shift ;;
    --skip) skip=${2:?--skip needs step names}; shift ;;
    --epochs) epochs=${2:?--epochs needs a number}; shift ;;
    --jobs) jobs=${2:?--jobs needs a number}; shift ;;
    --arch) arch=${2:?--arch needs an SM number such as 90}; shift ;;
    --no-link-data) link_data=0 ;;
    --cpu-dry-run) dry=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
fatal() { echo "gpu_check.sh: $*" >&2; exit 2; }
steps="env configure build ctest readme train prefetch verify-scatter verify-allreduce compare skew comm torch"
for s in ${only//,/ } ${skip//,/ }; do
  [[ " $steps " == *" $s "* ]] || fatal "--only/--skip: no step '$s'; the steps: $steps"
done

abs() { case "$1" in /*) echo "$1" ;; *) echo "$here/$1" ;; esac; }
kit=$(abs "$kit") out=$(abs "$out")
if [ -z "$build" ]; then
  if [ $dry = 1 ]; then build="build-gpu-dry"; else build="build-gpu"; fi
fi
build=$(abs "$build")
prefix=$kit/prefix/usr
data=$kit/fashion-mnist
[ -d "$prefix/include" ] && [ -f "$data/train-images-idx3-ubyte.gz" ] ||
  fatal "no kit at $kit (want prefix/usr/include and fashion-mnist/): run scripts/gpu_kit.sh on a Debian machine with apt, then copy gpu-kit/ here (--kit DIR)"

# --- the machine ------------------------------------------------------------------------------------
nvcc=$(command -v nvcc || true)
[ -z "$nvcc" ] && [ -x /usr/local/cuda/bin/nvcc ] && nvcc=/usr/local/cuda/bin/nvcc
if [ $dry = 0 ]; then
  command -v nvidia-smi > /dev/null ||
    fatal "nvidia-smi not found: this does not look like a GPU machine (no NVIDIA driver). Use --cpu-dry-run to test the script without a GPU."
  [ -n "$nvcc" ] || fatal "nvcc not found (not on PATH, not /usr/local/cuda/bin/nvcc): the CUDA backend cannot be built. Install the CUDA toolkit or put nvcc on PATH."
  if [ -z "$arch" ]; then
    arch=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2> /dev/null | head -1 | tr -d ' .\r')
    [[ "$arch" =~ ^[0-9]+$ ]] || { echo "gpu_check.sh: nvidia-smi gave no compute capability; building for 90 (H100/H200), --arch to change" >&2; arch=90; }
  fi
fi
if [ -z "$jobs" ]; then
  if [ $dry = 1 ]; then jobs=2; else jobs=$(nproc); fi
fi
nice=()
[ $dry = 1 ] && nice=(nice -n 10)  # a dry run shares a small machine
generator=()
command -v ninja > /dev/null && generator=(-G Ninja)

# A Python that has torch: $PYTHON, python3, or Debian's /usr/bin/python3 (a dry run on Debian).
py=""
for p in ${PYTHON:-} python3 /usr/bin/python3; do
  if command -v "$p" > /dev/null && "$p" -c 'import torch' 2> /dev/null; then py=$(command -v "$p"); break; fi
done
[ -n "$py" ] || py=$(command -v python3 || echo python3)

# cuDNN and NCCL: find_dep (scripts/gpu_libs.sh).
# shellcheck source=scripts/gpu_libs.sh
. "$here/scripts/gpu_libs.sh"
cuda_hints=() lib_dirs=()
if [ $dry = 0 ]; then
  for dep in cudnn nccl; do
    found=$(find_dep $dep)
    if [ -n "$found" ]; then
      upper=$(tr a-z A-Z <<< "$dep")
      cuda_hints+=(-D"${upper}_LIBRARY=${found%%$'\t'*}" -D"${upper}_INCLUDE_DIR=${found#*$'\t'}")
      lib_dirs+=("$(dirname "${found%%$'\t'*}")")
    else
      echo "gpu_check.sh: $dep not found under /usr/local/cuda or PyTorch's nvidia.$dep wheel: configure will search on its own" >&2
    fi
  done
  cuda_hints+=(-DCMAKE_CUDA_COMPILER="$nvcc" -DCMAKE_CUDA_ARCHITECTURES="$arch")
fi
# dp runs (and the build runs dp_tests to list its cases) with the wheels' libraries on the path:
# cuDNN loads its sub-libraries from its own folder. Then the toolkit's, and last the kit's (its only
# runtime library is libz.so.1, which the binaries' RUNPATH names too: CMake adds the folder of the
# kit's libz.so it linked).
base_ld=${LD_LIBRARY_PATH:-}
[ $dry = 0 ] && [ -d /usr/local/cuda/lib64 ] && lib_dirs+=(/usr/local/cuda/lib64)
lib_dirs+=("$prefix/lib/x86_64-linux-gnu")
dp_ld=$(IFS=:; echo "${lib_dirs[*]}")${base_ld:+:$base_ld}
dp_env=(env LD_LIBRARY_PATH="$dp_ld")
backend=cuda
[ $dry = 1 ] && backend=cpu

# README commands and dp_train's default --data read /usr/share/datasets/fashion-mnist: on a
# throwaway GPU machine (as root) it is linked to the kit's copy when absent (--no-link-data: not).
data_note=""
if [ $dry = 0 ] && [ $link_data = 1 ] && [ ! -e /usr/share/datasets/fashion-mnist ]; then
  if mkdir -p /usr/share/datasets 2> /dev/null && ln -s "$data" /usr/share/datasets/fashion-mnist 2> /dev/null; then
    data_note="linked /usr/share/datasets/fashion-mnist -> $data (for the README commands)"
  else
    data_note="/usr/share/datasets/fashion-mnist is absent and could not be linked: the readme step will fail"
  fi
fi

mkdir -p "$out" || fatal "cannot create $out"
rm -f "$out"/[0-9][0-9]-*.log "$out"/*.json "$out"/summary.txt "$out"/gpu_check.log "$out"/LastTest.log
exec > >(tee "$out/gpu_check.log") 2>&1
tee_pid=$!
echo "gpu_check.sh: $([ $dry = 1 ] && echo "CPU DRY RUN (no GPU used)" || echo "GPU check, sm_$arch"); kit $kit; build $build; output $out"
[ -n "$data_note" ] && echo "gpu_check.sh: $data_note"
if [ $dry = 1 ] && [ -z "$only" ] && [[ ",$skip," != *",readme,"* ]]; then
  skip="${skip:+$skip,}readme"  # minutes on a small machine; --only readme runs it
  echo "gpu_check.sh: the readme step is left out of a dry run (--only readme runs it)"
fi

# --- steps --------------------------------------------------------------------------------------------
names=() codes=() statuses=() seconds=() keys=()
n=0 failed=0
selected() {
  [ -n "$only" ] && [[ ",$only," != *",$1,"* ]] && return 1
  [ -n "$skip" ] && [[ ",$skip," == *",$1,"* ]] && return 1
  return 0
}
json() {  # file, python expression over j (the parsed file): prints it, or nothing
  "$py" -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2> /dev/null
}
# step NAME TIMEOUT FUNCTION: runs FUNCTION under a time limit with its output in OUT/NN-NAME.log.
# FUNCTION returns the command's exit code; it may set KEY (the key number) and BAD (a check failed).
step() {
  local name=$1 limit=$2 fn=$3 log rc t0 status
  selected "$name" || return 0
  n=$((n + 1))
  log=$out/$(printf '%02d' $n)-$name.log
  KEY="" BAD=""
  echo "== [$n] $name (limit ${limit}s) -> ${log#"$here"/}"
  t0=$(date +%s)
  LIMIT=$limit LOG=$log "$fn" > "$log" 2>&1
  rc=$?
  [ $rc = 124 ] && BAD="timed out after ${limit}s${BAD:+; $BAD}"
  status=ok
  if [ $rc != 0 ] || [ -n "$BAD" ]; then status=FAIL; failed=1; fi
  [ $status = FAIL ] && [ -z "$KEY" ] && KEY=$(grep -v '^\$ \|^ *$' "$log" | tail -1 | cut -c1-120)
  names+=("$name") codes+=("$rc") statuses+=("$status") seconds+=("$(($(date +%s) - t0))")
  keys+=("$KEY${BAD:+${KEY:+; }$BAD}")
  echo "   $status (exit $rc, ${seconds[-1]} s) ${keys[-1]}"
  if [ $status = FAIL ]; then tail -n 15 "$log" | sed 's/^/   | /'; fi
}
run() { echo "\$ $*"; timeout --kill-after=15 "$LIMIT" "${nice[@]}" "$@"; }
need() {  # binary: present, or say the build failed
  [ -x "$build/$1" ] && return 0
  echo "$build/$1 does not exist: the build step failed or did not run"
  return 127
}

s_env() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ); host $(hostname); $(uname -srm); $(nproc) cores"
  echo "mode: $([ $dry = 1 ] && echo "cpu dry run" || echo "gpu, sm_$arch")"
  local rc=0
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi; rc=$?
    nvidia-smi --query-gpu=name,compute_cap,driver_version,memory.total,clocks.max.sm --format=csv
  else
    echo "nvidia-smi: not found"
  fi
  echo "--- nvcc: ${nvcc:-none}"; [ -n "$nvcc" ] && "$nvcc" --version | tail -2
  echo "--- cmake: $(cmake --version | head -1); ninja: $(ninja --version 2> /dev/null || echo none); c++: $(c++ --version | head -1)"
  echo "--- python: $py"
  "$py" - << 'EOF'
try:
    import torch
    print("torch", torch.__version__, "cuda", torch.version.cuda, "cudnn", torch.backends.cudnn.version(),
          "cuda available", torch.cuda.is_available())
    if torch.cuda.is_available():
        print("device", torch.cuda.get_device_name(0), "capability", torch.cuda.get_device_capability(0))
        print("nccl", torch.cuda.nccl.version())
except Exception as e:
    print("torch: not usable:", e)
EOF
  echo "--- cmake hints: ${cuda_hints[*]:-(none: CPU-only build)}"
  local h
  for h in "${cuda_hints[@]}"; do
    case "$h" in
      -DCUDNN_INCLUDE_DIR=*) grep -hE '#define CUDNN_(MAJOR|MINOR|PATCHLEVEL) ' "${h#*=}"/cudnn_version.h "${h#*=}"/cudnn.h 2> /dev/null ;;
      -DNCCL_INCLUDE_DIR=*) grep -hE '#define NCCL_(MAJOR|MINOR|PATCH) ' "${h#*=}"/nccl.h 2> /dev/null ;;
    esac
  done
  ls /usr/local/cuda/lib64/libcublas.so* 2> /dev/null | head -1 || echo "no libcublas under /usr/local/cuda/lib64"
  echo "--- LD_LIBRARY_PATH for dp: $dp_ld"
  echo "--- kit: $kit"; cat "$kit/MANIFEST"
  [ $dry = 1 ] && KEY="cpu dry run" ||
    KEY="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null | head -1), sm_$arch"
  return $rc
}

s_configure() {
  local cuda=ON
  [ $dry = 1 ] && cuda=OFF
  run cmake -S "$here" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DDP_CUDA=$cuda \
    -DCMAKE_PREFIX_PATH="$prefix" "${cuda_hints[@]}"
  local rc=$?
  echo "--- where the dependencies were found (CMakeCache.txt):"
  grep -E '^(BLIS_|ZLIB_|CUDNN_|NCCL_|CLI11_DIR|nlohmann_json_DIR|doctest_DIR|CMAKE_CUDA_ARCHITECTURES|CMAKE_CUDA_COMPILER:)' "$build/CMakeCache.txt" 2> /dev/null
  local line
  line=$(grep -o 'dp: CUDA backend [A-Z]*' "$LOG" | tail -1)
  KEY=${line:-"no 'dp: CUDA backend' line"}
  [ $dry = 0 ] && [ "$line" != "dp: CUDA backend ON" ] && BAD="the CUDA backend is not on"
  return $rc
}

s_build() {
  # doctest_discover_tests runs dp_tests after linking it: it needs the libraries dp runs with
  LD_LIBRARY_PATH="$dp_ld" run cmake --build "$build" -j "$jobs"
  local rc=$?
  KEY="$(ls "$build"/dp_train "$build"/dp_bench "$build"/dp_tests 2> /dev/null | wc -l)/3 binaries"
  return $rc
}

s_ctest() {
  need dp_tests || return $?
  (cd "$build" && LD_LIBRARY_PATH="$dp_ld" run ctest -j "$jobs" --output-on-failure --timeout 900 -E '^readme:')
  local rc=$? summary gpu skipped cuda_cases
  cp "$build/Testing/Temporary/LastTest.log" "$out/LastTest.log" 2> /dev/null
  summary=$(grep -E '[0-9]+% tests passed' "$LOG" | tail -1)
  gpu=$(grep -E 'Test +#[0-9]+: cuda: GPU cases' "$LOG" | tail -1)
  gpu=$(sed -E 's/.*\.\.\.+ *(\*\*\*)?([A-Za-z ]+[A-Za-z]).*/\2/' <<< "$gpu")
  # backends(): "CUDA case skipped: no CUDA device (...)", once per test body that ran without one
  skipped=$(grep -c 'CUDA case skipped' "$build/Testing/Temporary/LastTest.log" 2> /dev/null)
  cuda_cases=$(grep -cE 'Test +#[0-9]+: cuda: ' "$LOG")
  KEY="${summary:-no ctest summary}; GPU entry: ${gpu:-absent}; ${cuda_cases} 'cuda:' entries; ${skipped:-0} 'CUDA case skipped'"
  if [ $dry = 0 ]; then
    [ "$gpu" = Passed ] || BAD="the GPU entry is ${gpu:-absent}, not Passed"
    [ "${skipped:-0}" -gt 0 ] && BAD="${BAD:+$BAD; }tests fell back to simulated devices"
  fi
  return $rc
}

s_readme() {
  need dp_train || return $?
  local gpus
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
  if [ $dry = 0 ] && [ "$gpus" -lt 2 ]; then  # CI runs them on simulated devices
    echo "not run: the README's commands name two or more devices (--gpus 0,1) and this machine has $gpus GPU(s)"
    KEY="not run: needs 2 GPUs, found $gpus"
    return 0
  fi
  (cd "$build" && LD_LIBRARY_PATH="$dp_ld" run ctest -V -R '^readme:')
  local rc=$?
  KEY=$(grep -oE '[0-9]+ README commands run, .*' "$LOG" | tail -1)
  return $rc
}

backend_is() {  # report: BAD unless it ran on $backend (a report exists only when the run got that far)
  local got
  [ -f "$1" ] || return 0
  got=$(json "$1" 'j["config"]["backend"]')
  [ "$got" = "$backend" ] || BAD="ran on the ${got:-unknown} backend, not $backend"
}
train_args() {  # sizes: a dry run trains a little
  if [ $dry = 1 ]; then echo "--epochs 1 --limit-train 4096 --limit-test 1000"; else echo "--epochs $epochs"; fi
}
s_train() {
  need dp_train || return $?
  # shellcheck disable=SC2046
  run "${dp_env[@]}" "$build/dp_train" --backend $backend --gpus 0 --data "$data" $(train_args) \
    --report "$out/train.json"
  local rc=$?
  KEY=$(json "$out/train.json" '"test acc %.4f, %.0f img/s, backend %s (%s)" % (j["test_accuracy"], j["images_per_second"], j["config"]["backend"], ",".join(j["config"]["device_names"]))')
  backend_is "$out/train.json"
  return $rc
}

s_prefetch() {
  need dp_train || return $?
  local steps=2000 sizes=(--limit-test 1000) rc=0 round mode flag
  [ $dry = 1 ] && steps=20 sizes=(--limit-train 4096 --limit-test 256)
  for round in 1 2 3; do
    for mode in on off; do
      flag=()
      [ $mode = off ] && flag=(--no-prefetch)
      run "${dp_env[@]}" "$build/dp_train" --backend $backend --gpus 0 --data "$data" --steps $steps "${sizes[@]}" \
        "${flag[@]}" --quiet --log-every $steps --log "$out/prefetch-$mode-$round.jsonl" || rc=$?
    done
  done
  # The last step record of each run: images/s over its training steps, device 0's load phase.
  KEY=$("$py" - "$out" << 'EOF'
import json, statistics, sys
def last(mode, r):
    recs = [json.loads(l) for l in open(f"{sys.argv[1]}/prefetch-{mode}-{r}.jsonl")]
    s = [x for x in recs if x["kind"] == "step"][-1]
    return s["images_per_second"], s["phase_ms"]["device0"]["load"]
try:
    on, off = ([last(m, r) for r in (1, 2, 3)] for m in ("on", "off"))
except (OSError, ValueError, KeyError, IndexError):
    sys.exit()
ratio = statistics.median(a[0] / b[0] for a, b in zip(on, off))
med = lambda v, i: statistics.median(x[i] for x in v)
print(f"img/s prefetch {med(on, 0):.0f} / --no-prefetch {med(off, 0):.0f} (paired median {ratio:.3f}x); "
      f"load {med(on, 1):.4f} / {med(off, 1):.4f} ms a step")
EOF
)
  return $rc
}

verify() {  # strategy
  need dp_train || return $?
  local limit=()
  [ $dry = 1 ] && limit=(--limit-train 4096 --limit-test 256)
  run "${dp_env[@]}" "$build/dp_train" --backend $backend --gpus 0,0 --allow-shared-device --sync "$1" \
    --verify --steps 20 --data "$data" "${limit[@]}" --report "$out/verify-$1.json"
  local rc=$?
  KEY=$(json "$out/verify-$1.json" '"max diff %.3g <= tolerance %.3g: %s, %.0f img/s" % (j["verify"]["max_abs_diff"], j["verify"]["tolerance"], j["verify"]["ok"], j["images_per_second"])')
  backend_is "$out/verify-$1.json"
  return $rc
}
s_verify_scatter() { verify scatter; }
s_verify_allreduce() { verify allreduce; }

bench_devices=(--backend "$backend" --gpus "0,0" --allow-shared-device)
s_compare() {
  need dp_bench || return $?
  local small=()
  [ $dry = 1 ] && small=(--steps 2 --warmup 1 --repeats 2)
  run "${dp_env[@]}" "$build/dp_bench" compare "${bench_devices[@]}" --batch 256 "${small[@]}" --json "$out/compare.json"
  local rc=$?
  local rates
  rates=$(grep -E '^images/s' "$LOG" | tail -1 | sed -E 's/^images\/s +//; s/ +/ \/ /g')
  [ -n "$rates" ] && KEY="img/s scatter / naive / allreduce: $rates"
  [ $rc = 0 ] && ! grep -q '^bytes: measured == model' "$LOG" && BAD="no 'bytes: measured == model' line"
  return $rc
}
s_skew() {
  need dp_bench || return $?
  run "${dp_env[@]}" "$build/dp_bench" skew "${bench_devices[@]}" --json "$out/skew.json"
  local rc=$?
  # "  skew = device 0's peak / mean peak of the others = ... = 1.085", scatter's first, allreduce's second
  local skews
  skews=$(grep -E '^ +skew = ' "$LOG" | sed -E 's/.* = //' | paste -sd/ | sed 's|/| / |g')
  [ -n "$skews" ] && KEY="device 0's skew, scatter / allreduce: $skews"
  return $rc
}
s_comm() {
  need dp_bench || return $?
  local small=()
  [ $dry = 1 ] && small=(--max-bytes 64K --iters 4 --repeats 2)
  run "${dp_env[@]}" "$build/dp_bench" comm "${bench_devices[@]}" "${small[@]}" --json "$out/comm.json"
  local rc=$?
  # the table's last row (the largest message: all_reduce's busbw is its 4th column), and the median fit
  local busbw fit
  busbw=$(awk '$2 ~ /^(B|KiB|MiB|GiB)$/ { last = "all_reduce busbw " $5 " GB/s at " $1 " " $2 } END { print last }' "$LOG")
  fit=$(grep -oE 'α = [^(]*' "$LOG" | head -1 | sed 's/ *$//')
  [ -n "$busbw" ] && KEY="$busbw; $fit"
  return $rc
}

# bench/torch_compare.py measures CPU threads only (no device argument): bench/torch_gpu.py borrows its
# model (build) and data readers, and times on the GPU.
s_torch() {
  local dev=cuda args=(--epochs "$epochs")
  [ $dry = 1 ] && dev=cpu args=(--epochs 1 --max-steps 16)
  run "$py" "$here/bench/torch_gpu.py" --data "$data" --device $dev --batch 256 "${args[@]}" --json "$out/torch.json"
  local rc=$?
  KEY=$(json "$out/torch.json" '"test acc %.4f, %.0f img/s (%s)" % (j["test_accuracy"], j["images_per_second"], j["device"])')
  return $rc
}

step env 120 s_env
step configure 300 s_configure
step build 1800 s_build
step ctest 1800 s_ctest
step readme 900 s_readme
step train 900 s_train
step prefetch 600 s_prefetch
step verify-scatter 300 s_verify_scatter
step verify-allreduce 300 s_verify_allreduce
step compare 600 s_compare
step skew 300 s_skew
step comm 600 s_comm
step torch 900 s_torch

# --- summary ----------------------------------------------------------------------------------------
{
  echo
  echo "gpu_check.sh summary ($([ $dry = 1 ] && echo "CPU DRY RUN: nothing ran on a GPU" || echo "GPU sm_$arch"); logs in $out)"
  printf '%-17s %4s  %-4s %6s  %s\n' step exit ok secs "key number"
  for i in "${!names[@]}"; do
    printf '%-17s %4s  %-4s %6s  %s\n' "${names[$i]}" "${codes[$i]}" "${statuses[$i]}" "${seconds[$i]}" "${keys[$i]}"
  done
  echo "overall: $([ $failed = 0 ] && echo "every step passed" || echo "FAILED (see the steps marked FAIL)")"
} | tee "$out/summary.txt"
if [ -n "$tarball" ]; then
  tar -czf "$tarball" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed $out into $tarball"
fi
exec > /dev/null 2>&1
wait "$tee_pid" 2> /dev/null
exit $failed
