#!/usr/bin/env bash
# dp across two hosts, made on this machine of Linux network namespaces: hosts A and B, each with its
# own network stack and host name (a UTS namespace), joined by veth pairs to a bridge in a third
# namespace, where mpirun runs. mpirun starts its daemons (orted) on A and B through an rsh agent that
# does `ip netns exec` in place of ssh, from a hostfile of the hosts' addresses; the two ranks meet over
# TCP on the veths only (btl self,tcp: no shared memory between the "hosts"). Checks that the job exits
# 0, that the report lists one device on each host, that the veths carried at least the bytes the report
# counts across processes, and that the losses equal one process training on 2 devices.
# Only addresses inside the namespaces made here are used; they are removed on exit, with every process
# left in them; every wait is bounded. Where namespaces cannot be made: "skipped: ..." and exit 77.
#
#   tests/two_hosts.sh DP_TRAIN MPIRUN     # ctest -R two_hosts
set -euo pipefail
train=${1:?usage: two_hosts.sh DP_TRAIN MPIRUN}
mpirun=${2:-}  # empty where CMake found none: skipped
train=$(realpath "$train")
skip() {
  echo "skipped: $*"
  exit 77
}
[ -x "$train" ] || { echo "two_hosts.sh: $train is not an executable" >&2; exit 1; }
[ -x "$mpirun" ] || skip "no mpirun ('$mpirun') (apt-get install openmpi-bin)"
[ "$(id -u)" = 0 ] || skip "network namespaces need root (this is uid $(id -u))"
for tool in ip unshare timeout; do
  command -v "$tool" > /dev/null || skip "$tool is missing (iproute2, util-linux, coreutils)"
done

# Names carry this shell's pid, so two runs at once do not meet; the subnet lives only inside them.
a=dp$$a b=dp$$b br=dp$$br net=10.213.7
tmp=$(mktemp -d)
made=()
cleanup() {
  local ns pid pids="" alive _
  for ns in "${made[@]}"; do pids+=" $(ip netns pids "$ns" 2> /dev/null || true)"; done
  for pid in $pids; do kill -KILL "$pid" 2> /dev/null || true; done
  for _ in {1..50}; do  # until they are gone (reaped), 5 s at most
    alive=0
    for pid in $pids; do kill -0 "$pid" 2> /dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  for ns in "${made[@]}"; do ip netns del "$ns" 2> /dev/null || true; done
  rm -rf "$tmp"
}
trap cleanup EXIT
trap "exit 130" INT
trap "exit 143" TERM
for ns in "$br" "$a" "$b"; do
  ip netns add "$ns" 2> "$tmp/err" || skip "cannot make a network namespace: $(cat "$tmp/err")"
  made+=("$ns")
  ip -n "$ns" link set lo up
done
ip -n "$br" link add br0 type bridge 2> "$tmp/err" || skip "cannot make a bridge: $(cat "$tmp/err")"
ip -n "$br" addr add "$net.254/24" dev br0
ip -n "$br" link set br0 up
i=0
for ns in "$a" "$b"; do
  i=$((i + 1))
  ip link add eth0 netns "$ns" type veth peer name "v$i" netns "$br" 2> "$tmp/err" ||
    skip "cannot make a veth pair: $(cat "$tmp/err")"
  ip -n "$br" link set "v$i" master br0 up
  ip -n "$ns" addr add "$net.$i/24" dev eth0
  ip -n "$ns" link set eth0 up
done
ip netns exec "$a" unshare --uts true 2> "$tmp/err" || skip "cannot give a namespace its own host name: $(cat "$tmp/err")"

# The rsh agent: `AGENT HOST COMMAND...` as ssh would, in HOST's namespace under its own host name.
cat > "$tmp/agent" << EOF
#!/bin/sh
while [ "\${1#-}" != "\$1" ]; do shift; done  # options ssh would take
case "\$1" in
  $net.1) ns=$a ;;
  $net.2) ns=$b ;;
  *) echo "two_hosts agent: unknown host \$1" >&2; exit 255 ;;
esac
shift
exec ip netns exec "\$ns" unshare --uts sh -c 'hostname "\$0" && exec sh -c "\$1"' "\$ns" "\$*"
EOF
chmod +x "$tmp/agent"
printf '%s slots=1\n' "$net.1" "$net.2" > "$tmp/hosts"

# A small IDX data set: label i%10, a bright band at rows 2k+3..2k+5 over noise (tests/util.h's
# write_synthetic_dataset, here in awk); 96 training images, batches of 24: 4 steps an epoch.
idx() { # PREFIX N
  LC_ALL=C awk -v n="$2" -v img="$tmp/data/$1-images-idx3-ubyte" -v lab="$tmp/data/$1-labels-idx1-ubyte" '
    function be32(x, f) { printf "%c%c%c%c", int(x / 16777216) % 256, int(x / 65536) % 256, int(x / 256) % 256, x % 256 > f }
    BEGIN {
      s = 7
      be32(2051, img); be32(n, img); be32(28, img); be32(28, img)
      be32(2049, lab); be32(n, lab)
      for (i = 0; i < n; i++) {
        k = i % 10; printf "%c", k > lab
        for (p = 0; p < 784; p++) {
          s = (s * 1103515245 + 12345) % 2147483648; v = int(s / 65536) % 60
          r = int(p / 28); if (r >= 2 * k + 3 && r < 2 * k + 6) v += 180
          printf "%c", v > img
        }
      }
    }'
}
mkdir "$tmp/data"
idx train 96
idx t10k 20
steps=12
args=(--backend cpu --sync allreduce --data "$tmp/data" --batch 24 --steps "$steps" --quiet)

tx() { ip netns exec "$1" cat /sys/class/net/eth0/statistics/tx_bytes; }  # bytes eth0 of NS sent
tx0=("$(tx "$a")" "$(tx "$b")")
start=$SECONDS
rc=0
env OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_mpi_yield_when_idle=1 \
  timeout -s KILL 60 ip netns exec "$br" "$mpirun" -np 2 --hostfile "$tmp/hosts" \
  --mca plm_rsh_agent "$tmp/agent" --mca oob_tcp_if_include "$net.0/24" \
  --mca btl self,tcp --mca btl_tcp_if_include "$net.0/24" \
  "$train" "${args[@]}" --devices 1 --report "$tmp/two.json" > "$tmp/two.out" 2>&1 || rc=$?
if [ "$rc" != 0 ]; then
  cat "$tmp/two.out"
  [ "$rc" = 137 ] && rc="137: killed after 60 s, a hang"
  echo "two_hosts.sh: FAILED: mpirun across the two namespaces exited $rc" >&2
  exit 1
fi
echo "mpirun -np 2 across $a and $b: exit 0 in $((SECONDS - start)) s"
timeout -s KILL 60 "$train" "${args[@]}" --devices 2 --report "$tmp/one.json" > "$tmp/one.out" 2>&1 ||
  { cat "$tmp/one.out"; echo "two_hosts.sh: FAILED: one process --devices 2" >&2; exit 1; }

failed=0
check() { # WHAT OK
  if [ "$2" = 1 ]; then echo "ok: $1"; else echo "FAILED: $1" >&2; failed=1; fi
}
# One device on each host: the report's devices (pretty-printed JSON, one key a line) name their
# host, which each namespace's UTS name makes the namespace's name.
hosts=$(sed -n 's/^ *"host": "\([^"]*\)".*/\1/p' "$tmp/two.json" | tr '\n' ' ')
check "the report's devices are on hosts $a and $b (it says: $hosts)" "$([ "$hosts" = "$a $b " ] && echo 1)"
processes=$(sed -n 's/^ *"process": \([0-9]*\).*/\1/p' "$tmp/two.json" | tr '\n' ' ')
check "one device in each process (processes: $processes)" "$([ "$processes" = "0 1 " ] && echo 1)"
# The veths carried the gradients: each host sent at least what the report counts for its device
# across processes per step, times the steps (plus the broadcast, the report, MPI's own messages).
mapfile -t sent < <(sed -n 's/^ *"inter_process_bytes_sent_per_step": \([0-9]*\).*/\1/p' "$tmp/two.json")
i=0
for ns in "$a" "$b"; do
  grew=$(($(tx "$ns") - ${tx0[$i]}))
  need=$((${sent[$i]:-1} * steps))
  check "$ns's veth sent $grew bytes >= ${sent[$i]:-?} across processes per step x $steps steps" \
    "$([ "${sent[$i]:-0}" -gt 0 ] && [ "$grew" -ge "$need" ] && echo 1)"
  i=$((i + 1))
done
# The same training as one process with both devices: with one device a process, the all-reduce
# sums the same two gradients as the in-process ring does (a + b, exact in either order), so every
# epoch's losses and accuracies and the final ones are equal to the last digit.
values() { grep -o "\"$1\": [^,]*" "$2" | sed 's/.*: //' | tr '\n' ' '; }
for key in train_loss test_loss test_accuracy; do
  m=$(values "$key" "$tmp/two.json") o=$(values "$key" "$tmp/one.json")
  check "$key across the two hosts ($m) = one process on 2 devices ($o)" "$([ -n "$m" ] && [ "$m" = "$o" ] && echo 1)"
done
if [ "$failed" != 0 ]; then
  echo "--- mpirun's output"
  cat "$tmp/two.out"
  exit 1
fi
echo "two_hosts.sh: passed"
