#!/usr/bin/env bash
# dp against PyTorch on this machine's CPU cores, side by side: builds dp (CPU only) and runs
# bench/torch_compare.py, which trains LeNet and LeNet-5 at batch 256 with both on 1 core and on 2
# cores and prints images/s, GFLOP/s, the fraction of FP32 peak and the ratios against the targets.
#
#   bench/cpu_speed.sh                      # build into build-cpu-speed/, compare (~10 minutes)
#   BUILD=build bench/cpu_speed.sh          # use (and build) another build directory
#   bench/cpu_speed.sh --repeats 5 --json out.json   # arguments go to torch_compare.py
#   bench/cpu_speed.sh --dp-before /path/to/old/dp_train   # also measure an older dp_train
#
# Measures the PyTorch of scripts/deps.sh --bench's environment (.venv-bench: today's 2.x, eager and
# torch.compile'd) and Debian's python3-torch (1.13) where installed; nothing is downloaded. On a
# machine other processes are using, pass --quiet-wait 120 to wait for quiet moments before each
# measurement; each line reports how many cores the other processes used meanwhile ("bg").
set -euo pipefail
here=$(cd -P "$(dirname "$0")/.." && pwd)  # -P: the repository, also when bench/ is reached by a link
build=${BUILD:-$here/build-cpu-speed}
cmake -S "$here" -B "$build" -DDP_CUDA=OFF -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build "$build" --target dp_train -j"$(nproc)" >/dev/null
python=/usr/bin/python3  # the driver: any interpreter with torch (for the models' FLOP count)
[ -x "$here/.venv-bench/bin/python" ] && python=$here/.venv-bench/bin/python
exec "$python" "$here/bench/torch_compare.py" --dp-train "$build/dp_train" "$@"
