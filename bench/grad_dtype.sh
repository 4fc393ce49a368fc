#!/usr/bin/env bash
# dp_train --grad-dtype fp32, bf16 and fp16 side by side, in two tables.
#   1. What the gradients' type saves a step, from dp_bench compare (allreduce, the ring; synthetic data):
#      the bytes device 0 sends, the step time here, and the communication's share of the step as the
#      alpha-beta model costs it on a 10 Gb/s Ethernet link between hosts (alpha 10 us, beta 1.25 GB/s) beside
#      the compute measured here, for 2 and 4 devices and --accumulate 1 and 4.
#   2. What it costs in accuracy: allreduce on 2 devices, EPOCHS epochs of IMAGES Fashion-MNIST images, the
#      test accuracy of each type (its --report), the bytes and images/s.
#   BUILD=build bench/grad_dtype.sh [EPOCHS [IMAGES]]   (default 10 epochs of 60,000: dp_train's own run)
set -euo pipefail
build=${BUILD:-build}
epochs=${1:-10} images=${2:-60000}
for n in "$epochs" "$images"; do
  [[ $n =~ ^[1-9][0-9]*$ ]] || { echo "grad_dtype.sh: '$n' is not a positive count (EPOCHS, IMAGES)" >&2; exit 2; }
done
for b in dp_train dp_bench; do
  [ -x "$build/$b" ] || { echo "grad_dtype.sh: no $build/$b; build first (BUILD=dir picks it)" >&2; exit 2; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
alpha_us=10 beta_gbps=1.25

echo "communication per step, allreduce (ring), lenet, micro-batches of 64 (dp_bench compare, synthetic data):"
printf '%8s %-5s %11s %15s %14s %22s\n' devices type --accumulate "sent/step (B)" "step ms here" \
  "comm share at 10 Gb/s"
for n in 2 4; do
  for accumulate in 1 4; do
    for t in fp32 bf16 fp16; do
      "$build/dp_bench" compare --devices "$n" --batch 64 --accumulate "$accumulate" --steps 10 --warmup 2 \
        --grad-dtype "$t" --alpha-us "$alpha_us" --beta-gbps "$beta_gbps" --json "$tmp/c.json" > /dev/null
      python3 - "$tmp/c.json" "$n" "$t" "$accumulate" <<'PY'
import json, sys
run = json.load(open(sys.argv[1]))["runs"][0]
s = next(x for x in run["strategies"] if x["strategy"] == "allreduce")
sent = s["devices"][0]["bytes_sent"]
step = s["step_ms"]["median"]
compute = step - s["comm_measured_ms"]  # what is left of the step here without its communication
share = s["comm_model_ms"] / (compute + s["comm_model_ms"])
print(f"{sys.argv[2]:>8} {sys.argv[3]:<5} {sys.argv[4]:>11} {sent:>15,} {step:>14.2f} {share:>22.1%}")
PY
    done
  done
done

echo
echo "accuracy, allreduce on 2 devices, $epochs epochs of $images Fashion-MNIST images (dp_train --report):"
printf '%-5s %15s %10s %9s\n' type "sent/step (B)" images/s "test acc"
for t in fp32 bf16 fp16; do
  # shellcheck disable=SC2086 # DP_FLAGS is a list of flags
  "$build/dp_train" --devices 2 --sync allreduce --limit-train "$images" --epochs "$epochs" --quiet --grad-dtype "$t" \
    ${DP_FLAGS:-} --report "$tmp/r.json"
  python3 - "$tmp/r.json" "$t" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
sent = r["devices"][0]["bytes_sent_per_step"]
print(f"{sys.argv[2]:<5} {sent:>15,} {r['images_per_second']:>10,.0f} {r['test_accuracy']:>9.4f}")
PY
done
