#!/usr/bin/env bash
# dp_train --accumulate beside plain batches on the same data: each run's step in images, what device 1
# sends a step and per image, images/s and the test accuracy after a short run (its --report), on 2
# simulated devices (or --backend cuda ones, given in DP_FLAGS). A step of 4 micro-batches of 64 trains
# on the images of a batch of 256 with a micro-batch's memory; the table shows what it costs.
#   BUILD=build bench/accumulate.sh [EPOCHS [IMAGES]]   (default 2 epochs of 16,384 Fashion-MNIST images)
set -euo pipefail
build=${BUILD:-build}
epochs=${1:-2} images=${2:-16384}
for n in "$epochs" "$images"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "accumulate.sh: '$n' is not a positive count (EPOCHS, IMAGES)" >&2; exit 2; }
done
[ -x "$build/dp_train" ] || { echo "accumulate.sh: no $build/dp_train; build first (BUILD=dir picks it)" >&2; exit 2; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
printf '%-10s %6s %11s %12s %15s %13s %10s %9s\n' sync --batch --accumulate "step images" "sent/step (B)" \
  "sent/image" "images/s" "test acc"
for run in "allreduce 64 1" "allreduce 256 1" "allreduce 64 4" "allreduce 32 8" "scatter 256 1" "scatter 64 4" \
  "zero3 256 1" "zero3 64 4"; do
  read -r sync batch accumulate <<< "$run"
  # shellcheck disable=SC2086 # DP_FLAGS is a list of flags
  "$build/dp_train" --devices 2 --limit-train "$images" --limit-test 2000 --epochs "$epochs" --quiet --sync "$sync" \
    --batch "$batch" --accumulate "$accumulate" ${DP_FLAGS:-} --report "$tmp/r.json"
  python3 - "$tmp/r.json" "$sync" "$batch" "$accumulate" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
images = r["config"]["step_images"]
sent = r["devices"][1]["bytes_sent_per_step"]
print(f"{sys.argv[2]:<10} {sys.argv[3]:>6} {sys.argv[4]:>11} {images:>12} {sent:>15,} {sent / images:>13,.0f} "
      f"{r['images_per_second']:>10,.0f} {r['test_accuracy']:>9.4f}")
PY
done
