#!/usr/bin/env bash
# dp_bench scale's model against two processes under mpirun (the part of its validation that crosses
# processes): the model of `mpirun -np 2 dp_train --devices 1 --sync allreduce` built from what one
# process measures, set beside that run.
#   1. the collectives across the two processes: `mpirun -np 2 dp_bench comm --devices 1`, dp's
#      all-reduce over the message sizes, fitted here to t = alpha + bytes / beta (least squares in
#      relative error, as dp_bench fits its own; bytes: the busiest rank's, 2 (n - 1) / n of S);
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

mpirun -np 2 "$build/dp_bench" comm --devices 1 --max-bytes 8M --json "$tmp/comm.json" > "$tmp/comm.log"
read -r alpha_us beta_gbps < <(/usr/bin/python3 - "$tmp/comm.json" << 'EOF'
import json, sys
pts = [p for p in json.load(open(sys.argv[1]))["points"] if p["dp"]["time_us"] > 0]
# t = a + x c, x the busiest rank's bytes (2 (n - 1) / n of S), c = 1 / beta; weights 1 / t
rows = [(p["bytes"] * 2 * (p["dp"]["ranks"] - 1) / p["dp"]["ranks"], p["dp"]["time_us"] * 1e-6) for p in pts]
s = [[0.0, 0.0], [0.0, 0.0]]
r = [0.0, 0.0]
for x, t in rows:
    w = 1 / (t * t)
    s[0][0] += w; s[0][1] += w * x; s[1][1] += w * x * x
    r[0] += w * t; r[1] += w * x * t
s[1][0] = s[0][1]
det = s[0][0] * s[1][1] - s[0][1] * s[1][0]
a = (r[0] * s[1][1] - s[0][1] * r[1]) / det
c = (s[0][0] * r[1] - s[1][0] * r[0]) / det
print(f"{max(a, 0) * 1e6:.3f} {1 / c / 1e9:.4f}")
EOF
)
echo "across the 2 processes (mpirun -np 2 dp_bench comm --devices 1, fitted here): alpha $alpha_us us, beta $beta_gbps GB/s"

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
