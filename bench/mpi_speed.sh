#!/usr/bin/env bash
# Across processes against one process, side by side on this machine: `mpirun -np 2 dp_train --devices 1`
# and `dp_train --devices 2` (both --sync allreduce, simulated devices), alternating, for lenet and lenet5;
# prints each run's images/s (the last epoch's), the ratio of the best of each and the median of the
# rounds' ratios (each round runs the two back to back, so its ratio shares the machine's load of the
# moment; on a shared machine one lucky run moves the best-of ratio, the median less).
#
#   bench/mpi_speed.sh [ROUNDS]      # default 3 rounds; BUILD=dir picks the build (default build-blas)
set -euo pipefail
here=$(cd -P "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build-blas}
rounds=${1:-3}
source "$here/bench/mpi_common.sh"
echo "$machine; $args"
for model in lenet lenet5; do
  best_mpi=0 best_one=0 ratios=""
  for ((i = 1; i <= rounds; i++)); do
    m=$(mpirun -np 2 "$build/dp_train" $args --model "$model" --devices 1 | rate)
    o=$("$build/dp_train" $args --model "$model" --devices 2 | rate)
    echo "  $model round $i: mpirun -np 2 --devices 1: $m img/s   one process --devices 2: $o img/s"
    ((m > best_mpi)) && best_mpi=$m
    ((o > best_one)) && best_one=$o
    ratios+="$(awk "BEGIN{print $m/$o}") "
  done
  median=$(echo "$ratios" | tr ' ' '\n' | grep . | sort -g | awk '{v[NR]=$1} END{printf "%.2f", NR%2 ? v[(NR+1)/2] : (v[NR/2]+v[NR/2+1])/2}')
  echo "$model: best $best_mpi vs $best_one img/s: 2 processes / 1 process = $(awk "BEGIN{printf \"%.2f\", $best_mpi/$best_one}")x; median of the rounds' ratios ${median}x (target 0.9x)"
done
