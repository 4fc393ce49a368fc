#!/usr/bin/env bash
# dp_bench scale's model against two processes under mpirun (the part of its validation that crosses
# processes): the model of `mpirun -np 2 dp_train --devices 1 --sync allreduce` built from what one
# process measures, set beside that run.
#   1. the collectives across the two processes: `mpirun -np 2 dp_bench comm --devices 1 --repeats 3`,
#      dp's all-reduce over the message sizes, each of three sweeps fitted to t = alpha + bytes / beta
#      (bytes: the busiest rank's, 2 (n - 1) / n of S), the median of the fits (its JSON's alpha_beta);
#   2. the compute: `dp_train --devices 1` at --batch B, its step = B / images/s;
#   3. the model: `dp_bench scale --preset sim --alpha-us --beta-gbps --compute-us --devices 2`;
#   4. the measurement: `mpirun -np 2 dp_train --devices 1` at --batch 2B, its step = 2B / images/s;
# then the error. Simulated devices, Fashion-MNIST (dp_train's default --data), ROUNDS alternated
# rounds of 2 and 4 (default 3), the median printed.
#
#   bench/scale_processes.sh [ROUNDS]     # BUILD=dir picks the build (default build)
set -euo pipefail
here=$(cd -P "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build}
rounds=${1:-3}
# shellcheck source=bench/mpi_common.sh  # OpenMPI settings, rate, $machine
source "$here/bench/mpi_common.sh"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
B=256
train=(--backend cpu --sync allreduce --epochs 2 --limit-train 15360 --limit-test 1000)
echo "$machine"

# dp_bench comm fits t = alpha + bytes / beta to each of its --repeats sweeps alone and takes the
# median: one sweep on a loaded machine can time its small sizes slower than its large ones (seen
# here: 3.2 ms at the small sizes, a beta below 0, no fit for that sweep).
sweeps=3
mpirun -np 2 "$build/dp_bench" comm --devices 1 --max-bytes 8M --repeats $sweeps --json "$tmp/comm.json" > "$tmp/comm.log"
read -r alpha_us beta_gbps < <(/usr/bin/python3 -c "
import json, sys
ab = json.load(open(sys.argv[1]))['alpha_beta']
if ab: print('%.3f %.4f' % (ab['alpha_us'], ab['beta_gbps']))" "$tmp/comm.json") || true  # no line: no fit, said below
if [ -z "${beta_gbps:-}" ]; then
  echo "scale_processes.sh: none of $sweeps sweeps across the 2 processes fitted t = alpha + bytes / beta with a" \
    "beta above 0 (their small sizes timed as slow as their large ones: is the machine busy?); dp_bench comm said:" >&2
  grep -A$((sweeps + 1)) 'fit of dp' "$tmp/comm.log" >&2 || true
  exit 1
fi
echo "across the 2 processes (mpirun -np 2 dp_bench comm --devices 1 --repeats $sweeps, its fit):" \
  "alpha $alpha_us us, beta $beta_gbps GB/s"

step_us() { awk -v b="$1" -v r="$2" 'BEGIN { printf "%.1f", b / r * 1e6 }'; }
errors=""
for ((i = 1; i <= rounds; i++)); do
  one=$("$build/dp_train" "${train[@]}" --devices 1 --batch $B | rate)
  two=$(mpirun -np 2 "$build/dp_train" "${train[@]}" --devices 1 --batch $((2 * B)) | rate)
  compute=$(step_us $B "$one")
  measured=$(step_us $((2 * B)) "$two")
  "$build/dp_bench" scale --preset sim --alpha-us "$alpha_us" --beta-gbps "$beta_gbps" --compute-us "$compute" \
    --validate none --devices 2 --per-device $B --json "$tmp/scale.json" > /dev/null
  model=$(/usr/bin/python3 -c "
import json
j = json.load(open('$tmp/scale.json'))
print('%.1f' % ([p for s in j['strategies'] if s['strategy'] == 'allreduce' for p in s['points'] if p['devices'] == 2][0]['step_seconds'] * 1e6))")
  err=$(awk -v m="$model" -v t="$measured" 'BEGIN { printf "%+.1f", (m - t) / t * 100 }')
  echo "  round $i: one process, 1 device: $one img/s ($compute us a step); 2 processes: $two img/s ($measured us a step); model $model us: ${err}%"
  errors+="$err "
done
median=$(echo "$errors" | tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END{printf "%+.1f", NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
echo "the model's step for 2 processes against the measured: median error ${median}%"
