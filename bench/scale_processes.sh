#!/usr/bin/env bash
# dp_bench scale's model against two processes under mpirun (the part of its validation that crosses
# processes): the model of `mpirun -np 2 dp_train --devices 1 --sync allreduce` built from what one
# process measures, set beside that run.
#   1. the collectives across the two processes: `mpirun -np 2 dp_bench comm --devices 1`, dp's
#      all-reduce over the message sizes, three times, fitted here to t = alpha + bytes / beta as
#      dp_bench fits its own (bytes: the busiest rank's, 2 (n - 1) / n of S; the median of the fits);
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

# Three sweeps, each fitted as dp_bench fits its own (bench.cpp's fit_alpha_beta: least squares in
# relative error, weights 1 / t^2; a negative alpha clamped to 0 and beta refitted alone; no fit where
# beta comes out <= 0), alpha and beta each the median over the sweeps that fitted (median_fit): one
# sweep on a loaded machine can time its small sizes slower than its large ones (seen here: 3.2 ms at
# the small sizes, a beta below 0).
sweeps=3
for ((s = 1; s <= sweeps; s++)); do
  mpirun -np 2 "$build/dp_bench" comm --devices 1 --max-bytes 8M --json "$tmp/comm$s.json" > "$tmp/comm.log"
done
read -r alpha_us beta_gbps < <(/usr/bin/python3 - "$tmp"/comm*.json << 'EOF'
import json, statistics, sys
fits = []
for path in sys.argv[1:]:
    pts = [p for p in json.load(open(path))["points"] if p["dp"]["time_us"] > 0]
    # t = a + x c, x the busiest rank's bytes (2 (n - 1) / n of S), c = 1 / beta; weights 1 / t^2
    rows = [(p["bytes"] * 2 * (p["dp"]["ranks"] - 1) / p["dp"]["ranks"], p["dp"]["time_us"] * 1e-6) for p in pts]
    sw = sum(1 / t**2 for x, t in rows)
    sx = sum(x / t**2 for x, t in rows)
    sxx = sum(x * x / t**2 for x, t in rows)
    st = sum(1 / t for x, t in rows)
    sxt = sum(x / t for x, t in rows)
    det = sw * sxx - sx * sx
    if sw == 0 or det <= 0:
        continue
    a, c = (st * sxx - sx * sxt) / det, (sw * sxt - sx * st) / det
    if a < 0:
        a, c = 0.0, sxt / sxx
    if c > 0:
        fits.append((a, 1 / c))
if fits:
    print(f"{statistics.median(a for a, _ in fits) * 1e6:.3f} {statistics.median(b for _, b in fits) / 1e9:.4f}")
EOF
) || true  # no line where no sweep fitted: said just below
if [ -z "${beta_gbps:-}" ]; then
  echo "scale_processes.sh: none of $sweeps sweeps across the 2 processes fitted t = alpha + bytes / beta with a" \
    "beta above 0 (their small sizes timed as slow as their large ones: is the machine busy?)" >&2
  exit 1
fi
echo "across the 2 processes (mpirun -np 2 dp_bench comm --devices 1, $sweeps sweeps fitted here, the median):" \
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
