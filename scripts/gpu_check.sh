#!/usr/bin/env bash
# The first run of dp on a real GPU, in one command, on a machine without our Debian packages and
# without network (one H100/H200, CUDA 13 under /usr/local/cuda, CMake, ninja, PyTorch with its cuDNN
# and NCCL wheels). Run it there after scripts/gpu_kit.sh made the kit on a Debian machine and the kit
# was copied into the repository's root (relative paths below are taken from that root):
#
#   scripts/gpu_check.sh [--kit DIR] [--out DIR] [--build DIR] [--tar FILE] [--only a,b] [--skip a,b]
#                        [--epochs N] [--jobs N] [--arch SM] [--deadline SECONDS] [--no-link-data]
#                        [--cpu-dry-run]
#
# Steps (names for --only/--skip) in the order they run, each logged to OUT/NN-step.log; a failed step
# does not stop the next; the most telling first, so that a --deadline cuts what matters least:
#   env       versions of the driver, GPU, nvcc, cmake, ninja, compiler, PyTorch; cuDNN and NCCL, each
#             library's own version (cudnnGetVersion, ncclGetVersion) against its header's, which must match
#   configure cmake -DDP_CUDA=ON for this GPU's architecture, BLIS/zlib/doctest/CLI11/nlohmann-json from
#             the kit (CMAKE_PREFIX_PATH), cuDNN and NCCL from /usr/local/cuda or PyTorch's wheels
#   build     ninja, every target
#   cuda      the test suite's "cuda:" entries; fails if the "cuda: GPU cases" entry is Skipped or a
#             test says "CUDA case skipped" (a fallback to simulated devices)
#   train     dp_train --backend cuda --gpus 0, N epochs on the kit's Fashion-MNIST; fails under 0.85
#   profile   the GPU's time per kernel in one training step: ncu (--clock-control none) times every
#             kernel of a 10-step and a 30-step run; their difference over 20 is one step, without the
#             start, cuDNN's planning and the evaluation; caches flushed before each kernel (ncu's
#             default), then again kept as the kernel before left them (--cache-control none)
#   torch     PyTorch training the same LeNet at the same batch and epochs on the same GPU: eager, then
#             torch.compile(mode="reduce-overhead") (CUDA graphs; compile time apart)
#   graphs    dp_train --gpus 0 --steps 2000 with and without --graphs, 3 alternated rounds: images/s,
#             the host's time a step (--log's host_ms: enqueueing, waiting for the GPU, between two
#             steps), the graph launches the report counts (none fails the step), test accuracy of
#             each; then 16 steps of AdamW under a cosine schedule with --verify (2 captures, the
#             eager reference's weights)
#   run-ahead dp_train --gpus 0 --steps 2000 with --run-ahead and --no-run-ahead, with --graphs and eager,
#             3 alternated rounds each, no --log: images/s (paired medians), the steps started ahead
#             (none fails the step) and the first round's weights, which must be the same bits
#   sanitize  compute-sanitizer memcheck over the "cuda: ops:" cases, synccheck over those and the
#             "cuda:" cases of the step graphs, memcheck over the convolution cases under DP_CUDA_CONV=implicit
#             and racecheck over the implicit GEMMs' case (the test process alone), and synccheck over 6
#             steps of dp_train --graphs under DP_CUDA_STREAMS=2 DP_CUDA_PDL=1
#   stalls    why the longest kernels take their time: ncu's sections (throughput against peak, occupancy,
#             warp states, memory) over one step's launches of the profile step's 8 longest, 10 steps in;
#             per kernel its SM throughput, occupancy and longest warp stalls (scripts/ncu_stalls.py), and
#             the report (stalls.ncu-rep) with ncu's advice
#   fuse      DP_CUDA_FUSE=0 (the kernels the fused passes replace): the op, graph, run-ahead and
#             CPU-matching cases under it, and --graphs runs against the fused ones (the default), 3
#             alternated rounds; fc2's forward differs in the last bits: the test accuracies (all 10,000
#             test images) must lie within 0.01
#   streams   DP_CUDA_STREAMS=2 (each layer's weight gradients on a second stream, not the default): the
#             op, graph, run-ahead and CPU-matching cases under it, and --graphs runs against one stream,
#             3 alternated rounds; the weights must be the same bits
#   pdl       DP_CUDA_PDL=1 (programmatic dependent launches, not the default) likewise against ordinary ones
#   both      DP_CUDA_STREAMS=2 and DP_CUDA_PDL=1 together, likewise against neither
#   implicit  DP_CUDA_CONV=implicit (dp's implicit-GEMM convolutions, not the default): the convolution,
#             graph and CPU-matching cases and the plans' choices under it, its step's kernels under
#             ncu, and --graphs runs against the library path, 3 alternated rounds
#   verify-scatter, verify-allreduce
#             dp_train --backend cuda --gpus 0,0 --allow-shared-device --verify --steps 20
#   compare, skew, comm
#             dp_bench on --gpus 0,0 --allow-shared-device --backend cuda
#   prefetch  dp_train --gpus 0 --steps 2000 with and without --no-prefetch, 3 alternated rounds:
#             images/s and the load phase (ms a step), the copy stream's gain
#   nccl      NCCL on the one GPU (the test build's dp_train, DP_TEST_NCCL=always): a one-rank clique,
#             NCCL asked for a GPU named twice (the fallback), two ranks on it (NCCL_MULTI_RANK_GPU_ENABLE=1,
#             2.30 and later); what carried the collectives each time; fails if the one-rank run was not NCCL;
#             whether the cuda step ran two processes on the GPU (mpirun: only where the build has MPI)
#   ctest     the rest of the test suite (neither "cuda:" nor the README check)
#   readme    the README check (every build/dp_* line of README.md and docs/*.md at small sizes); its
#             commands name two GPUs, so on one it is skipped (counted as such, never as passed)
# A step whose dp_train/dp_bench prints a "warning:" (a cuDNN fallback, say) fails, as does one whose
# key number cannot be read from its own output.
# NCCL across processes on distinct GPUs (mpirun -np 2 dp_train --gpus ...) needs two GPUs: no step
# runs it. Two processes on the one GPU are a case of the cuda step where the build found an MPI (the
# nccl step says whether it ran). The run ends with a summary table (step, exit code, ok/FAIL/skip,
# seconds, key number) in OUT/summary.txt; the exit code is 1 if any step failed, 2 if the machine
# cannot run the check at all (no nvidia-smi, nvcc or kit).
#
# --deadline SECONDS: the whole run's budget from its start. Each step's limit is cut to what is left
# (less 20 s for the summary and the tarball), each command of a step is given what is left of that
# limit (a step of many commands, one of them hung, ends within it); a step with under 30 s left is
# skipped, and the summary and tarball are written all the same. On a machine lent for calls of at most
# 10 minutes and 15 minutes in all, its start included: one call with `--deadline 545 --only env,
# configure,build,cuda,train,profile,torch,graphs,run-ahead,sanitize,stalls,fuse,streams,pdl,both`
# (the steps up to sanitize took 298 s on an H200, 2026-11-28, the profile's second timing, about 20 s,
# aside; stalls and the four settings, never run, about a minute each by estimate, so the deadline may
# cut pdl and both; and about 40 s to start the machine). What it cut, at once while the machine is
# warm (its build kept): a second call with the minutes left (`--deadline` about 240 s, `--only` the
# steps cut), then give the machine back. Where a step failed, the second call runs what the fix
# touches instead: on a fresh machine the build comes first (configure,build). Where a fused kernel
# fails its `cuda: ops:` case, the second call can run the rest with DP_CUDA_FUSE=0 in the environment
# (every dp run inherits it). Left out of both: implicit and nccl (measured before), verify-*, compare,
# skew, comm, prefetch (20 s together); ctest and readme (the CPU cases, the README's two-GPU
# commands) belong to a longer loan.
#
# --cpu-dry-run runs the same steps on a machine without a GPU (CPU-only build, --backend cpu, small
# sizes, the GPU entry expected Skipped), so the script's own logic can be tested anywhere.
# --tar FILE also packs OUT into FILE. Where $OUT names a folder (a lent GPU machine brings back only
# what is written there, at most 8 files), --tar defaults to $OUT/gpu-check.tar.gz and the summary is
# also copied to $OUT/summary.txt.
# README commands and dp_train's default --data read /usr/share/datasets/fashion-mnist: where it is
# absent (the GPU machine), it is linked to the kit's copy, and the run says so (--no-link-data: not).
# Defaults: --kit gpu-kit, --out gpu-check-out, --build build-gpu (build-gpu-dry for a dry run),
# --epochs 10, --jobs: every core (2 in a dry run), --arch: nvidia-smi's compute capability, --deadline:
# none.
set -u
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here" || exit 2

kit=gpu-kit out=gpu-check-out build="" tarball="" only="" skip="" epochs=10 jobs="" arch="" dry=0 link_data=1
deadline=0 started=$(date +%s)
usage() { sed -n '2,/^[^#]/{/^#/p}' "$0"; }  # the header comment, whole
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
    --deadline) deadline=${2:?--deadline needs seconds}; shift ;;
    --no-link-data) link_data=0 ;;
    --cpu-dry-run) dry=1 ;;
    -h | --help) usage; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument '$1'" >&2; usage >&2; exit 2 ;;
  esac
  shift
done
fatal() { echo "gpu_check.sh: $*" >&2; exit 2; }
steps="env configure build cuda train profile stalls streams pdl both fuse implicit torch verify-scatter verify-allreduce compare skew comm prefetch graphs run-ahead nccl ctest readme sanitize"
[[ "$deadline" =~ ^[0-9]+$ ]] || fatal "--deadline: '$deadline' is not a whole number of seconds"
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ] && [ -z "$tarball" ]; then tarball=$OUT/gpu-check.tar.gz; fi
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

# A Python that has torch: $PYTHON, python3, or on a dry run scripts/deps.sh --bench's .venv-bench or
# Debian's /usr/bin/python3 (the torch step is skipped, naming why, where none has).
py=""
for p in ${PYTHON:-} python3 "$here/.venv-bench/bin/python" /usr/bin/python3; do
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
# what an earlier call on a warm machine left, so that no step reads another call's files
rm -f "$out"/[0-9][0-9]-*.log "$out"/*.json "$out"/*.jsonl "$out"/*.st "$out"/*.csv "$out"/*.ncu-rep \
  "$out"/summary.txt "$out"/gpu_check.log "$out"/LastTest.log
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
n=0 failed=0 skipped=0
warn_steps=" train profile stalls streams pdl both fuse implicit verify-scatter verify-allreduce compare skew comm prefetch graphs run-ahead nccl "  # dp's own runs
selected() {
  [ -n "$only" ] && [[ ",$only," != *",$1,"* ]] && return 1
  [ -n "$skip" ] && [[ ",$skip," == *",$1,"* ]] && return 1
  return 0
}
json() {  # file, python expression over j (the parsed file): prints it, or nothing
  "$py" -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2" 2> /dev/null
}
# two safetensors files: "same" or "DIFFERENT" (their data, after the header, whose metadata names the
# command), or nothing where one cannot be read
same_tensors() {
  "$py" - "$1" "$2" << 'EOF'
import struct, sys
def tensors(path):
    b = open(path, "rb").read()
    return b[8 + struct.unpack("<Q", b[:8])[0]:]
try:
    print("same" if tensors(sys.argv[1]) == tensors(sys.argv[2]) else "DIFFERENT")
except (OSError, struct.error):
    pass
EOF
}
# step NAME TIMEOUT FUNCTION: runs FUNCTION under a time limit with its output in OUT/NN-NAME.log.
# FUNCTION returns the command's exit code; it may set KEY (the key number), BAD (a check failed) and
# SKIP (the step could not run here, and why: counted apart, never as passed).
record() {  # name rc status seconds key
  names+=("$1") codes+=("$2") statuses+=("$3") seconds+=("$4") keys+=("$5")
  echo "   $3 (exit $2, $4 s) $5"
}
step() {
  local name=$1 limit=$2 fn=$3 log rc t0 status left
  selected "$name" || return 0
  if [ "$deadline" -gt 0 ]; then  # 20 s kept for the summary and the tarball
    left=$((deadline - ($(date +%s) - started) - 20))
    if [ $left -lt 30 ]; then
      skipped=$((skipped + 1))
      echo "== $name: skipped, ${left} s left of --deadline $deadline"
      record "$name" - skip 0 "skipped: --deadline $deadline reached"
      return 0
    fi
    [ $left -lt "$limit" ] && limit=$left
  fi
  n=$((n + 1))
  log=$out/$(printf '%02d' $n)-$name.log
  KEY="" BAD="" SKIP=""
  echo "== [$n] $name (limit ${limit}s) -> ${log#"$here"/}"
  t0=$(date +%s)
  LIMIT=$limit STEP_END=$((t0 + limit)) LOG=$log "$fn" > "$log" 2>&1
  rc=$?
  # 124: a command cut at the limit; past it, one cut or one not run (a step's last command's code wins)
  if [ $rc = 124 ] || [ $(($(date +%s) - t0)) -ge "$limit" ]; then BAD="timed out after ${limit}s${BAD:+; $BAD}"; fi
  if [[ "$warn_steps" == *" $name "* ]] && grep -qE '^dp(_train|_bench)?: warning:' "$log"; then
    BAD="${BAD:+$BAD; }a warning: $(grep -m1 -E '^dp(_train|_bench)?: warning:' "$log" | cut -c1-100)"
  fi
  status=ok
  [ -n "$SKIP" ] && status=skip skipped=$((skipped + 1)) KEY=$SKIP
  if [ $rc != 0 ] || [ -n "$BAD" ]; then status=FAIL; failed=1; fi
  [ $status = FAIL ] && [ -z "$KEY" ] && KEY=$(grep -v '^\$ \|^ *$' "$log" | tail -1 | cut -c1-120)
  record "$name" "$rc" $status "$(($(date +%s) - t0))" "$KEY${BAD:+${KEY:+; }$BAD}"
  if [ $status = FAIL ]; then tail -n 15 "$log" | sed 's/^/   | /'; fi
}
# Each command gets what is left of its step's limit (STEP_END), so a step of many commands, a hung
# one among them, ends within its limit and --deadline holds; none starts with under 5 s left (124).
run() {
  local left=$((STEP_END - $(date +%s)))
  echo "\$ $*"
  if [ $left -lt 5 ]; then
    echo "(not run: the step's ${LIMIT} s are spent)"
    return 124
  fi
  timeout --kill-after=5 "$left" "${nice[@]}" "$@"
}
need() {  # binary: present, or say the build failed
  [ -x "$build/$1" ] && return 0
  echo "$build/$1 does not exist: the build step failed or did not run"
  return 127
}

# shellcheck source=scripts/gpu_steps.sh
. "$here/scripts/gpu_steps.sh"
# shellcheck source=scripts/gpu_speed_steps.sh
. "$here/scripts/gpu_speed_steps.sh"

step env 120 s_env
step configure 300 s_configure
step build 1800 s_build
step cuda 600 s_cuda
step train 600 s_train
step profile 300 s_profile
step torch 600 s_torch
step graphs 600 s_graphs
step run-ahead 600 s_run_ahead
step sanitize 900 s_sanitize
step stalls 180 s_stalls
step fuse 300 s_fuse
step streams 300 s_streams
step pdl 300 s_pdl
step both 300 s_both
step implicit 300 s_implicit
step verify-scatter 300 s_verify_scatter
step verify-allreduce 300 s_verify_allreduce
step compare 600 s_compare
step skew 300 s_skew
step comm 600 s_comm
step prefetch 600 s_prefetch
step nccl 300 s_nccl
step ctest 1800 s_ctest
step readme 900 s_readme

# --- summary ----------------------------------------------------------------------------------------
{
  echo
  echo "gpu_check.sh summary ($([ $dry = 1 ] && echo "CPU DRY RUN: nothing ran on a GPU" || echo "GPU sm_$arch"); logs in $out)"
  printf '%-17s %4s  %-4s %6s  %s\n' step exit ok secs "key number"
  for i in "${!names[@]}"; do
    printf '%-17s %4s  %-4s %6s  %s\n' "${names[$i]}" "${codes[$i]}" "${statuses[$i]}" "${seconds[$i]}" "${keys[$i]}"
  done
  if [ $failed = 1 ]; then
    echo "overall: FAILED (see the steps marked FAIL)"
  elif [ $skipped -gt 0 ]; then
    echo "overall: no step failed, $skipped skipped (not passed: see the steps marked skip)"
  else
    echo "overall: every step passed"
  fi
  echo "total: $(($(date +%s) - started)) s"
} | tee "$out/summary.txt"
if [ -n "$tarball" ]; then
  tar -czf "$tarball" -C "$(dirname "$out")" "$(basename "$out")" && echo "packed $out into $tarball"
fi
if [ -n "${OUT:-}" ] && [ -d "${OUT:-}" ]; then cp "$out/summary.txt" "$OUT/summary.txt"; fi
exec > /dev/null 2>&1
wait "$tee_pid" 2> /dev/null
exit $failed
