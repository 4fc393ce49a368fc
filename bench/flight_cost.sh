#!/usr/bin/env bash
# What the flight recorder and the per-step desync check cost (engine/flight_recorder.h): `mpirun -np 2
# dp_train --devices 1` on lenet with them on (the default, 256 records) and off (--flight-records 0),
# alternating, each round the two back to back; prints each run's images/s (the last epoch's) and the
# median of the rounds' ratios, on over off (target: at least 0.98, a cost of at most 2% of a step).
#
#   bench/flight_cost.sh [ROUNDS]    # default 5 rounds; BUILD=dir picks the build (default build-blas)
set -euo pipefail
here=$(cd -P "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build-blas}
rounds=${1:-5}
source "$here/bench/mpi_common.sh"
args+=" --devices 1"
echo "$machine; mpirun -np 2 dp_train $args"
ratios=""
for ((i = 1; i <= rounds; i++)); do
  on=$(mpirun -np 2 "$build/dp_train" $args | rate)
  off=$(mpirun -np 2 "$build/dp_train" $args --flight-records 0 | rate)
  echo "  round $i: recorder and check on: $on img/s   off: $off img/s"
  ratios+="$(awk "BEGIN{print $on/$off}") "
done
median=$(echo "$ratios" | tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END{printf "%.3f", NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
echo "on / off: median of the rounds' ratios ${median}x (target >= 0.98x); the rounds' ratios: $ratios"
