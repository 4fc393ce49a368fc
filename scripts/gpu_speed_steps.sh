# Sourced by scripts/gpu_check.sh beside gpu_steps.sh (which says how a step is written): the steps that
# measure speed, paired runs of dp_train and ncu's kernel times.
# shellcheck shell=bash
# shellcheck disable=SC2154  # the variables are gpu_check.sh's

# Three alternated rounds of dp_train --gpus 0, with flags $2 and without them (or with $3), the
# environment's VAR=value words $4 and $5 likewise, evaluated on the first $6 test images (default 1000;
# 0: all): each run's log and report as $out/$1-{on,off}-{1,2,3}.{jsonl,json}.
alternate() {
  local name=$1 on=$2 off=${3:-} steps=2000 sizes=(--limit-test "${6:-1000}") rc=0 round mode flags vars
  [ $dry = 1 ] && steps=20 sizes=(--limit-train 4096 --limit-test 256)
  for round in 1 2 3; do
    for mode in on off; do
      flags=$on vars=${4:-}
      [ $mode = off ] && flags=$off vars=${5:-}
      # shellcheck disable=SC2086  # flags and vars are words
      run "${dp_env[@]}" $vars "$build/dp_train" --backend $backend --gpus 0 --data "$data" --steps $steps "${sizes[@]}" \
        $flags --quiet --log-every $steps --log "$out/$name-$mode-$round.jsonl" --report "$out/$name-$mode-$round.json" ||
        rc=$?
    done
  done
  return $rc
}
# What alternate's runs $1 measured, "on" named $2 and "off" $3: images/s of the last step record (paired
# median of the three rounds), device 0's load phase, the host's time a step (its thread enqueueing the
# step, waiting for the GPU, and the trainer's between two steps: what a graph and a loss read a step
# late would take), the graph launches (--graphs), the test accuracy, and whether the runs ran ahead
# (--run-ahead, dp_train's default on CUDA, with --log too since 2026-11-28: earlier calls did not).
paired() {
  "$py" - "$out" "$@" << 'EOF'
import json, statistics, sys
out, name, on_name, off_name = sys.argv[1:5]
def run(mode, r):
    recs = [json.loads(l) for l in open(f"{out}/{name}-{mode}-{r}.jsonl")]
    s = [x for x in recs if x["kind"] == "step"][-1]
    report = json.load(open(f"{out}/{name}-{mode}-{r}.json"))
    h = s["host_ms"]
    return (s["images_per_second"], s["phase_ms"]["device0"]["load"],
            report.get("graphs", {}).get("launches", 0), report["test_accuracy"],
            1e3 * h["enqueue"], 1e3 * h["wait"], 1e3 * h["between"], report["config"]["run_ahead"])
try:
    on, off = ([run(m, r) for r in (1, 2, 3)] for m in ("on", "off"))
except (OSError, ValueError, KeyError, IndexError):
    sys.exit()
ratio = statistics.median(a[0] / b[0] for a, b in zip(on, off))
med = lambda v, i: statistics.median(x[i] for x in v)
print(f"img/s {on_name} {med(on, 0):.0f} / {off_name} {med(off, 0):.0f} (paired median {ratio:.3f}x); "
      f"load {med(on, 1):.4f} / {med(off, 1):.4f} ms a step; host us a step: enqueue {med(on, 4):.0f} / "
      f"{med(off, 4):.0f}, wait {med(on, 5):.0f} / {med(off, 5):.0f}, between steps {med(on, 6):.0f} / "
      f"{med(off, 6):.0f}; {on[0][2]} graph launches; test acc {on[0][3]:.4f} / {off[0][3]:.4f}; "
      f"run-ahead {'on' if on[0][7] else 'off'} / {'on' if off[0][7] else 'off'}")
EOF
}

# The copy stream's gain: prefetch (the default) against --no-prefetch
s_prefetch() {
  need dp_train || return $?
  alternate prefetch "" --no-prefetch
  local rc=$?
  KEY=$(paired prefetch prefetch --no-prefetch)
  [ -n "$KEY" ] || BAD="the runs' logs give no images/s and load phase"
  return $rc
}

# --graphs against eager steps; a run that launched no graph fails the step
s_graphs() {
  need dp_train || return $?
  alternate graphs --graphs
  local rc=$?
  KEY=$(paired graphs --graphs eager)
  [ -n "$KEY" ] || BAD="the runs' logs and reports give no images/s and launches"
  case "$KEY" in *"; 0 graph launches"*) BAD="--graphs launched no graph" ;; esac
  backend_is "$out/graphs-on-1.json"
  # AdamW under a cosine schedule: the optimizer's scalars are read from device memory at each launch,
  # so two captures (one per upload slot) serve every step after the first, and the weights are the
  # eager reference's (--verify)
  run "${dp_env[@]}" "$build/dp_train" --backend $backend --gpus 0 --data "$data" --steps 16 --limit-test 256 \
    --graphs --verify --optimizer adamw --lr-schedule cosine --report "$out/graphs-adamw.json" || rc=$?
  local captures
  captures=$(json "$out/graphs-adamw.json" 'j["graphs"]["captures"]')
  [ "$captures" = 2 ] || BAD="--graphs with AdamW and a cosine schedule: ${captures:-no} captures, not 2"
  KEY="$KEY; adamw cosine: ${captures:-?} captures"
  return $rc
}

# A step started before the loss of the one before is read (--run-ahead, dp_train's default on CUDA)
# against each loss read at once (--no-run-ahead), with --graphs and eager: three alternated rounds of
# each pair without --log (its timing events, two a phase, are not what is measured),
# the reports' images/s (paired medians); the first round's checkpoints must hold the same tensors,
# bit for bit, and the run-ahead runs must have started steps ahead
s_run_ahead() {
  need dp_train || return $?
  local steps=2000 sizes=(--limit-test 1000) rc=0 round mode flags
  [ $dry = 1 ] && steps=20 sizes=(--limit-train 4096 --limit-test 256)
  for round in 1 2 3; do
    for mode in graphs-on graphs-off eager-on eager-off; do
      flags="--no-run-ahead"
      [[ $mode == *-on ]] && flags="--run-ahead"
      [[ $mode == graphs-* ]] && flags="$flags --graphs"
      [ $round = 1 ] && flags="$flags --save $out/run-ahead-$mode.st"
      # shellcheck disable=SC2086  # flags are words
      run "${dp_env[@]}" "$build/dp_train" --backend $backend --gpus 0 --data "$data" --steps $steps "${sizes[@]}" \
        $flags --quiet --report "$out/run-ahead-$mode-$round.json" || rc=$?
    done
  done
  local graphs_same eager_same
  graphs_same=$(same_tensors "$out/run-ahead-graphs-on.st" "$out/run-ahead-graphs-off.st")
  eager_same=$(same_tensors "$out/run-ahead-eager-on.st" "$out/run-ahead-eager-off.st")
  KEY=$("$py" - "$out" "$graphs_same" "$eager_same" << 'EOF2'
import json, statistics, sys
out, same = sys.argv[1], {"graphs": sys.argv[2], "eager": sys.argv[3]}
def runs(mode):
    return [json.load(open(f"{out}/run-ahead-{mode}-{r}.json")) for r in (1, 2, 3)]
try:
    parts = []
    for kind in ("graphs", "eager"):
        on, off = runs(kind + "-on"), runs(kind + "-off")
        if not all(j["config"]["run_ahead"] for j in on) or any(j["config"]["run_ahead"] for j in off):
            sys.exit()
        ahead = min(j["run_ahead"]["steps_started_ahead"] for j in on)
        ratio = statistics.median(a["images_per_second"] / b["images_per_second"] for a, b in zip(on, off))
        med = lambda v: statistics.median(j["images_per_second"] for j in v)
        if not same[kind]:  # a checkpoint missing or unreadable: same_tensors said nothing
            sys.exit()
        parts.append(f"{kind}: img/s run-ahead {med(on):.0f} / each loss at once {med(off):.0f} "
                     f"(paired median {ratio:.3f}x), {ahead} steps started ahead, weights {same[kind]}")
    print("; ".join(parts))
except (OSError, ValueError, KeyError, IndexError):
    pass
EOF2
)
  [ -n "$KEY" ] || BAD="the runs' reports give no images/s, or run_ahead is not as asked"
  case "$KEY" in *DIFFERENT*) BAD="run-ahead changed the weights" ;; *" 0 steps started ahead"*) BAD="no step ran ahead" ;; esac
  backend_is "$out/run-ahead-graphs-on-1.json"
  return $rc
}

ncu_path() { command -v ncu || ls /usr/local/cuda/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2> /dev/null | head -1; }
# ncu ($1) times every kernel of a 10-step and a 30-step run; the difference over 20 is one step, in
# $out/kernels$2.json ($2: "" or a name's suffix; $3: the environment's VAR=value words; $4: ncu's
# own further options)
kernel_times() {
  local steps rc=0
  for steps in 10 30; do
    # shellcheck disable=SC2086  # $3 and $4 are words
    run "${dp_env[@]}" $3 "$1" --clock-control none $4 --metrics gpu__time_duration.sum --print-units base --csv \
      --log-file "$out/ncu$2-$steps.csv" "$build/dp_train" --backend cuda --gpus 0 --data "$data" --steps $steps \
      --limit-test 256 --quiet || rc=$?
  done
  "$py" "$here/scripts/kernel_times.py" "$out/ncu$2-10.csv" "$out/ncu$2-30.csv" --steps 20 --json "$out/kernels$2.json"
  return $rc
}
# ncu's path in $ncu; where there is none, or in a dry run, SKIP says why and it returns 1
find_ncu() {
  ncu=$(ncu_path)
  [ $dry = 0 ] && [ -n "$ncu" ] && return 0
  SKIP="not run: $([ $dry = 1 ] && echo "cpu dry run" || echo "no ncu (PATH, /usr/local/cuda/bin, /opt/nvidia/nsight-compute)")"
  echo "$SKIP"
  return 1
}
s_profile() {
  need dp_train || return $?
  local ncu rc=0
  find_ncu || return 0
  kernel_times "$ncu" "" "" "" || rc=$?
  KEY=$(json "$out/kernels.json" '"%.1f us of kernels a step, %d launches; the longest: %s %.1f us" % (j["total_us"], j["launches"], j["kernels"][0]["name"][:40], j["kernels"][0]["us"])')
  [ -n "$KEY" ] || BAD="no kernel times read from ncu's output"
  # the same with what the kernel before left in the caches, as in a step: which kernels wait on memory
  kernel_times "$ncu" -warm "" "--cache-control none" || rc=$?
  local warm
  warm=$(json "$out/kernels-warm.json" '"%.1f us" % j["total_us"]')
  [ -n "$warm" ] || BAD="no kernel times read from ncu's output (caches kept)"
  KEY="$KEY; caches kept: $warm"
  return $rc
}

# Why the longest kernels take their time: ncu's sections on throughput against the GPU's peak,
# occupancy, launch, warp states, scheduler, memory and compute (no source counters: a small report)
# over one step's launches of the profile step's 8 longest kernels (scripts/ncu_stalls.py --pick), 10
# steps in. The report, $out/stalls.ncu-rep, opens in ncu (--import); its details page, with ncu's
# advice, is in the log; scripts/ncu_stalls.py sums up each kernel from its metrics.
s_stalls() {
  need dp_train || return $?
  local ncu rc=0 picked calls names s sections=()
  find_ncu || return 0
  picked=$("$py" "$here/scripts/ncu_stalls.py" --pick "$out/kernels.json" --top 8) ||
    { BAD="no kernels.json from the profile step"; return 1; }
  read -r calls names <<< "$picked"
  for s in SpeedOfLight Occupancy LaunchStats WarpStateStats SchedulerStats MemoryWorkloadAnalysis \
    ComputeWorkloadAnalysis; do sections+=(--section "$s"); done
  run "${dp_env[@]}" "$ncu" --clock-control none "${sections[@]}" --kernel-name-base demangled \
    --kernel-name "regex:$names" --launch-skip $((10 * calls)) --launch-count "$calls" --export "$out/stalls" \
    --force-overwrite "$build/dp_train" --backend cuda --gpus 0 --data "$data" --steps 14 --limit-test 256 \
    --quiet || rc=$?
  run "$ncu" --import "$out/stalls.ncu-rep" --page details || rc=$?
  run "$ncu" --import "$out/stalls.ncu-rep" --page raw --csv --print-units base --log-file "$out/stalls-raw.csv" ||
    rc=$?
  "$py" "$here/scripts/ncu_stalls.py" "$out/stalls-raw.csv" --json "$out/stalls.json" || rc=$?
  KEY=$(grep '^the longest: ' "$LOG" | tail -1 | cut -c14-)
  [ -n "$KEY" ] || BAD="no kernel read from ncu's report"
  return $rc
}

# A CUDA setting against its default, both the same kernels on the same data (compiled, not yet run on
# a GPU): the op, graph, run-ahead and three-steps-against-the-CPU cases under it, then --graphs runs
# each way, 3 alternated rounds: images/s (paired median), test accuracy, and the weights, which must be
# the same bits. $1 names the step's files, $2 is the setting, $3 the default, each one or more
# VAR=value words (the cases run under $2); $4 "close" where the two differ in the last bits: the
# weights are reported, and the first rounds' test accuracies, on all 10,000 test images, must lie
# within 0.01 (two trainings that part in the last bits disagree on several percent of the images, say
# 7%: on 1,000 the gap's standard deviation would be about 0.008, on 10,000 about 0.003). (ncu
# serialises kernels: its kernel times could show neither setting's gain.)
variant() {
  need dp_tests || return $?
  need dp_train || return $?
  local name=$1 on=$2 off=$3 bits=${4:-bits} rc=0 speed same gap tests=""  # "": alternate's default
  [ "$bits" = close ] && tests=0
  local cases='cuda: ops: *,cuda: graphs: *,cuda: run-ahead: *,cuda: three LeNet steps*'
  [ $dry = 1 ] && cases='ops: conv2d*,ops: linear*'  # the CPU build reads neither: the script's logic alone
  # shellcheck disable=SC2086  # the settings are words
  run "${dp_env[@]}" $on "$build/dp_tests" "--test-case=$cases" || rc=$?
  KEY="cases: $(grep -oE 'test cases: *[0-9]+ *\| *[0-9]+ passed *\| *[0-9]+ failed' "$LOG" | tail -1)"
  alternate "$name" "--graphs --save $out/$name-on.st" "--graphs --save $out/$name-off.st" "$on" "$off" "$tests" ||
    rc=$?
  speed=$(paired "$name" "$on" "$off")
  [ -n "$speed" ] || BAD="${BAD:+$BAD; }the runs' logs give no images/s"
  # a capture that failed trains eagerly, the same bits: none launched is a failure (so is its warning)
  case "$speed" in *"; 0 graph launches"*) BAD="${BAD:+$BAD; }no step ran as a graph with $on" ;; esac
  same=$(same_tensors "$out/$name-on.st" "$out/$name-off.st")
  if [ "$bits" = close ]; then
    gap=$("$py" -c 'import json, sys; a, b = (json.load(open(f))["test_accuracy"] for f in sys.argv[1:]); print("%.4f" % abs(a - b))' \
      "$out/$name-on-1.json" "$out/$name-off-1.json" 2> /dev/null)
    "$py" -c 'import sys; sys.exit(not float(sys.argv[1]) <= 0.01)' "${gap:-nan}" 2> /dev/null ||
      BAD="${BAD:+$BAD; }test accuracies with $on and $off: ${gap:+$gap apart (0.01 at most)}${gap:-a report missing}"
    [ -n "$same" ] || BAD="${BAD:+$BAD; }no checkpoint of $on or $off"
    same="${same:-unread} (the last bits may differ), test accuracies ${gap:-unread} apart"
  else
    [ "$same" = same ] || BAD="${BAD:+$BAD; }$on changed the weights (or no checkpoint: '$same')"
  fi
  KEY="$KEY; $speed; weights $same"
  backend_is "$out/$name-on-1.json"
  return $rc
}

# The weight gradients on a second stream (DP_CUDA_STREAMS=2: each linear layer's and im2col-path
# convolution's dw and db beside its dx) against one, the default.
s_streams() { variant streams DP_CUDA_STREAMS=2 DP_CUDA_STREAMS=1; }

# Programmatic dependent launches (DP_CUDA_PDL=1, kernels/cuda/launch.h: each kernel's blocks launched
# while the one before it runs, waiting for it first) against ordinary ones, the default.
s_pdl() { variant pdl DP_CUDA_PDL=1 DP_CUDA_PDL=0; }

# Both at once against neither: what the two give together (a kernel of the second stream launched
# programmatically after its fork's event wait, say), the step the defaults would take if both gain.
s_both() { variant both "DP_CUDA_STREAMS=2 DP_CUDA_PDL=1" "DP_CUDA_STREAMS=1 DP_CUDA_PDL=0"; }

# The kernels the fused passes replace (DP_CUDA_FUSE=0: lenet's conv1 forward and dw, conv2's db, fc2
# each way; the cases run under it) against the fused ones, the default: what fusing gains, side by side.
s_fuse() { variant fuse DP_CUDA_FUSE=0 DP_CUDA_FUSE=1 close; }

# dp's implicit-GEMM convolutions (DP_CUDA_CONV=implicit: lenet's conv2 forward, dw and db without
# cuDNN, im2col or cuBLAS; compiled, not yet run on a GPU) against the library path (the default): the
# convolution, graph and three-steps-against-the-CPU cases and the plans' choices under it, the step's
# kernels under ncu, and --graphs runs each way, 3 alternated rounds: images/s (paired median) and test
# accuracy. Fails where a case fails or no plan took the path. (The sanitize step runs memcheck under it.)
s_implicit() {
  need dp_tests || return $?
  need dp_train || return $?
  local rc=0 ncu want=implicit
  local cases='cuda: ops: conv2d*,cuda: implicit GEMM*,cuda: cuDNN runs every model*,cuda: graphs: *,cuda: three LeNet steps*'
  [ $dry = 1 ] && cases='ops: conv2d*' want=library  # the CPU build has no such path: the script's logic alone
  run "${dp_env[@]}" DP_CUDA_CONV=$want "$build/dp_tests" "--test-case=$cases" || rc=$?
  KEY="cases: $(grep -oE 'test cases: *[0-9]+ *\| *[0-9]+ passed *\| *[0-9]+ failed' "$LOG" | tail -1)"
  ncu=$(ncu_path)
  if [ $dry = 0 ] && [ -n "$ncu" ]; then
    kernel_times "$ncu" -implicit DP_CUDA_CONV=implicit "" || rc=$?
    KEY="$KEY; $(json "$out/kernels-implicit.json" '"%.1f us of kernels a step, %d launches" % (j["total_us"], j["launches"])')"
  fi
  alternate implicit --graphs --graphs "DP_CUDA_CONV=$want" DP_CUDA_CONV=library || rc=$?
  local speed
  speed=$(paired implicit "$want" library)
  [ -n "$speed" ] || BAD="${BAD:+$BAD; }the runs' logs give no images/s"
  KEY="$KEY; $speed"
  backend_is "$out/implicit-on-1.json"
  return $rc
}
