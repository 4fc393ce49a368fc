#!/usr/bin/env bash
# Where one training step's time goes on one core, dp beside PyTorch: dp_bench ops (one simulated
# device, every kernel call timed) and bench/torch_profile.py (torch.profiler's self time per op, eager
# and torch.compile'd, one thread), same model and batch. The PyTorch side needs scripts/deps.sh
# --bench's environment (.venv-bench).
#   bench/cpu_speed_profile.sh [MODEL]        (default lenet; BUILD=dir picks the build, as cpu_speed.sh)
set -euo pipefail
here=$(cd -P "$(dirname "$0")/.." && pwd)
build=${BUILD:-$here/build-cpu-speed}
model=${1:-lenet}
python=$here/.venv-bench/bin/python
[ -x "$python" ] || { echo "cpu_speed_profile.sh: no $python; scripts/deps.sh --bench makes it" >&2; exit 2; }
cmake -S "$here" -B "$build" -DDP_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target dp_bench -j"$(nproc)" >/dev/null
"$build/dp_bench" ops --model "$model" --batch 256 --steps 20 | grep -v '^memory:'
for mode in compile eager; do
  echo
  "$python" "$here/bench/torch_profile.py" --model "$model" --mode "$mode" --threads 1 --batch 256 --top 12 2>/dev/null
done
