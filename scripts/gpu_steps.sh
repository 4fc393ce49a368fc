# Sourced by scripts/gpu_check.sh: its steps, one function each (s_NAME), run by its step() with LIMIT and LOG
# set; each returns the command's exit code and may set KEY, BAD and SKIP (gpu_check.sh says what they mean).
# The steps that measure speed are in gpu_speed_steps.sh.
# shellcheck shell=bash
# shellcheck disable=SC2154  # the variables are gpu_check.sh's

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
  local dep found lib_v head_v versions=""
  for dep in cudnn nccl; do
    [ $dry = 1 ] && break
    found=$(find_dep $dep)
    [ -n "$found" ] || { echo "$dep: no folder holds both the library and its header"; BAD="${BAD:+$BAD; }no $dep"; continue; }
    lib_v=$(lib_version $dep "${found%%$'\t'*}") head_v=$(header_version $dep "${found#*$'\t'}")
    echo "$dep: library ${found%%$'\t'*} reports ${lib_v:-?}; header ${found#*$'\t'} declares ${head_v:-?}"
    versions="$versions, $dep ${lib_v:-?}"
    [ -n "$lib_v" ] && [ "$lib_v" = "$head_v" ] || BAD="${BAD:+$BAD; }$dep's library (${lib_v:-?}) and header (${head_v:-?}) differ"
  done
  # NCCL 2.30 lets two ranks share one GPU (NCCL_MULTI_RANK_GPU_ENABLE=1): the only NCCL a one-GPU machine can run
  [ $dry = 0 ] && [ -n "${lib_v:-}" ] && echo "nccl: $([ "$lib_v" -ge 23000 ] && echo "2.30 or newer: NCCL_MULTI_RANK_GPU_ENABLE exists" || echo "older than 2.30: two ranks cannot share one GPU")"
  ls /usr/local/cuda/lib64/libcublas.so* 2> /dev/null | head -1 || echo "no libcublas under /usr/local/cuda/lib64"
  echo "--- LD_LIBRARY_PATH for dp: $dp_ld"
  echo "--- kit: $kit"; cat "$kit/MANIFEST"
  [ $dry = 1 ] && KEY="cpu dry run" ||
    KEY="$(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2> /dev/null | head -1), sm_$arch$versions"
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

s_cuda() {
  need dp_tests || return $?
  (cd "$build" && LD_LIBRARY_PATH="$dp_ld" run ctest -j "$jobs" --output-on-failure --timeout 900 -R '^cuda: ')
  local rc=$? summary gpu skipped cuda_cases
  cp "$build/Testing/Temporary/LastTest.log" "$out/LastTest-cuda.log" 2> /dev/null
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

s_ctest() {
  need dp_tests || return $?
  (cd "$build" && LD_LIBRARY_PATH="$dp_ld" run ctest -j "$jobs" --output-on-failure --timeout 900 -E '^(readme|cuda): ')
  local rc=$?
  cp "$build/Testing/Temporary/LastTest.log" "$out/LastTest.log" 2> /dev/null
  KEY=$(grep -E '[0-9]+% tests passed' "$LOG" | tail -1)
  [ -n "$KEY" ] || BAD="no ctest summary"
  return $rc
}

s_readme() {
  need dp_train || return $?
  local gpus
  gpus=$(nvidia-smi -L 2> /dev/null | grep -c '^GPU')
  if [ $dry = 0 ] && [ "$gpus" -lt 2 ]; then  # CI runs them on simulated devices
    echo "not run: the README's commands name two or more devices (--gpus 0,1) and this machine has $gpus GPU(s)"
    SKIP="not run: needs 2 GPUs, found $gpus"
    return 0
  fi
  (cd "$build" && LD_LIBRARY_PATH="$dp_ld" run ctest -V -R '^readme:')
  local rc=$?
  KEY=$(grep -oE '[0-9]+ README commands run, .*' "$LOG" | tail -1)
  [ -n "$KEY" ] || BAD="no 'README commands run' line"
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
  local acc floor=0.85
  [ $dry = 1 ] && floor=0.25  # one small epoch
  acc=$(json "$out/train.json" 'j["test_accuracy"]')
  if [ -z "$acc" ]; then
    BAD="${BAD:+$BAD; }no test accuracy in train.json"
  elif ! awk -v a="$acc" -v f=$floor 'BEGIN { exit !(a >= f) }'; then
    BAD="${BAD:+$BAD; }test accuracy $acc under $floor"
  fi
  return $rc
}

# NCCL on the one GPU (the test build's dp_train, DP_TEST_NCCL=always): a one-rank clique, NCCL asked for
# a GPU named twice (the fallback), and two ranks on it where NCCL is 2.30 or newer; what carried the
# collectives each time (the report's config.collectives), or why it did not run. Two processes on the
# GPU under mpirun are a case of the cuda step, run where the build found an MPI: said which here.
# --timeout 60: two ranks on one GPU from two threads is what NCCL's guide calls unsafe; a hang gives
# up in a minute.
s_nccl() {
  need dp_train_failpoints || return $?
  local rc=0 name env gpus got says=()
  local -a runs=("one-rank:DP_TEST_NCCL=always:0" "shared:DP_TEST_NCCL=always NCCL_MULTI_RANK_GPU_ENABLE=0:0,0"
    "two-ranks:DP_TEST_NCCL=always NCCL_MULTI_RANK_GPU_ENABLE=1:0,0")
  [ $dry = 1 ] && runs=("one-rank:DP_TEST_NCCL=always:0")
  for r in "${runs[@]}"; do
    IFS=: read -r name env gpus <<< "$r"
    # shellcheck disable=SC2086  # env is words
    run "${dp_env[@]}" $env "$build/dp_train_failpoints" --backend $backend --gpus $gpus --allow-shared-device \
      --sync allreduce --bucket-kb 64 --verify --steps 6 --timeout 60 --data "$data" --limit-test 256 --report "$out/nccl-$name.json" || rc=$?
    got=$(json "$out/nccl-$name.json" 'j["config"]["collectives"]')
    says+=("$name: ${got:-failed}")
  done
  # as the case itself asks (tests/mpi_job.h, have_mpi): a build with MPI (dp_tests links it), its mpiexec
  local mpiexec
  mpiexec=$(sed -n 's/^MPIEXEC_EXECUTABLE:FILEPATH=//p' "$build/CMakeCache.txt" 2> /dev/null)
  if ldd "$build/dp_tests" 2> /dev/null | grep -q libmpi && [ -x "$mpiexec" ]; then
    says+=("processes: in the cuda step (mpirun -np 2)")
  else
    says+=("processes: not run (no MPI in this build, or no mpiexec)")
  fi
  KEY=$(IFS=';'; echo "${says[*]}" | sed 's/;/; /g')
  [ $dry = 0 ] && ! grep -q "one-rank: nccl" <<< "$KEY" && BAD="the one-rank clique did not run NCCL"
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
  local rates names
  rates=$(grep -E '^images/s' "$LOG" | tail -1 | sed -E 's/^images\/s +//; s/ +/ \/ /g')
  names=$(grep -B40 -E '^images/s' "$LOG" | grep -E '^ +scatter +' | tail -1 | sed -E 's/^ +//; s/ +/ \/ /g')
  [ -n "$rates" ] && KEY="img/s ${names:-?}: $rates"
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
  [ -n "$skews" ] && KEY="device 0's skew, scatter / allreduce / zero1 / zero2 / zero3: $skews"
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
  local dev=cuda args=(--epochs "$epochs") rc=0 mode modes=(eager reduce-overhead) rates=()
  [ $dry = 1 ] && dev=cpu args=(--epochs 1 --max-steps 16) modes=(eager)  # Debian's torch 1.13 cannot compile
  if ! "$py" -c 'import torch, numpy' 2> /dev/null; then  # a GPU machine has one; a dry run's may not
    local why="no Python with torch and numpy (\$PYTHON, python3, .venv-bench, /usr/bin/python3; scripts/deps.sh --bench)"
    echo "$why"
    if [ $dry = 1 ]; then SKIP="not run: $why"; else BAD=$why; fi
    return 0
  fi
  for mode in "${modes[@]}"; do
    run "$py" "$here/bench/torch_gpu.py" --data "$data" --device $dev --batch 256 --mode $mode "${args[@]}" \
      --json "$out/torch-$mode.json" || rc=$?
    rates+=("$(json "$out/torch-$mode.json" '"%s: test acc %.4f, %.0f img/s (compile %.0f s)" % (j["mode"], j["test_accuracy"], j["images_per_second"], j["compile_s"])')")
  done
  KEY="${rates[0]}${rates[1]:+; ${rates[1]}}"
  [ -n "${rates[0]}" ] || BAD="no eager result in torch-eager.json"
  [ $dry = 1 ] || [ -n "${rates[1]}" ] || BAD="${BAD:+$BAD; }no reduce-overhead result in torch-reduce-overhead.json"
  KEY="$KEY; torch $(json "$out/torch-eager.json" 'j["torch"]') on $(json "$out/torch-eager.json" 'j["device"]')"
  return $rc
}

sanitizer_path() { command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2> /dev/null | head -1; }
s_sanitize() {
  need dp_tests || return $?
  local cs
  cs=$(sanitizer_path)
  if [ $dry = 1 ] || [ -z "$cs" ]; then
    SKIP="not run: $([ $dry = 1 ] && echo "cpu dry run" || echo "no compute-sanitizer")"
    echo "$SKIP"
    return 0
  fi
  # memcheck over the kernels; synccheck over them and the step graphs (their captures and launches);
  # memcheck over the convolutions again under DP_CUDA_CONV=implicit (dp's implicit GEMMs), and
  # racecheck (shared memory's hazards) over the implicit GEMMs' own case; memcheck over the
  # convolutions and linear layers under DP_CUDA_STREAMS=2 (a second column matrix in the workspace).
  # The test process alone (the settings' graph cases start 20 dp_train runs, each minutes under a
  # tool); then synccheck over a few steps of one dp_train in graphs under DP_CUDA_STREAMS=2 and
  # DP_CUDA_PDL=1: the lanes' fork and join and the programmatic edges, captured and launched.
  local rc=0 tool cases conv streams
  for tool in memcheck synccheck memcheck-implicit racecheck-implicit memcheck-streams; do
    cases='cuda: ops: *' conv=library streams=1
    [ $tool = synccheck ] && cases='cuda: ops: *,cuda: graphs: *'
    [ $tool = memcheck-implicit ] && cases='cuda: ops: conv2d*' conv=implicit
    [ $tool = racecheck-implicit ] && cases='cuda: implicit GEMM*' conv=implicit
    [ $tool = memcheck-streams ] && cases='cuda: ops: conv2d*,cuda: ops: linear*' streams=2
    run "${dp_env[@]}" DP_CUDA_CONV=$conv DP_CUDA_STREAMS=$streams "$cs" --tool "${tool%-*}" --error-exitcode 99 \
      --target-processes application-only "$build/dp_tests" "--test-case=$cases" || rc=$?
    KEY="${KEY:+$KEY; }$tool: $(grep -oE 'ERROR SUMMARY: [0-9]+ errors?' "$LOG" | tail -1)"
    KEY="$KEY, $(grep -oE 'test cases: *[0-9]+ *\| *[0-9]+ passed *\| *[0-9]+ failed' "$LOG" | tail -1)"
  done
  run "${dp_env[@]}" DP_CUDA_STREAMS=2 DP_CUDA_PDL=1 "$cs" --tool synccheck --error-exitcode 99 \
    "$build/dp_train" --backend $backend --gpus 0 --data "$data" --graphs --steps 6 --limit-test 1000 || rc=$?
  KEY="$KEY; synccheck-both: $(grep -oE 'ERROR SUMMARY: [0-9]+ errors?' "$LOG" | tail -1)"
  return $rc
}

