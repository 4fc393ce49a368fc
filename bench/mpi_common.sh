# shellcheck shell=bash disable=SC2034  # sourced: its variables are the sourcing script's
# What bench/mpi_speed.sh and bench/flight_cost.sh share (sourced): OpenMPI's settings for a 2-core
# machine run as root on loopback, the training both time, how to read its images/s, and the machine.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_rmaps_base_oversubscribe=1 \
  OMPI_MCA_btl_tcp_if_include=lo OMPI_MCA_oob_tcp_if_include=lo OMPI_MCA_mpi_yield_when_idle=1
args="--backend cpu --sync allreduce --epochs 2 --limit-train 15360 --limit-test 1000 --batch 256"
rate() { grep '^epoch 2/' | sed -E 's/.* ([0-9]+) img\/s.*/\1/'; }  # the last epoch's images/s
isa=$(grep -q avx512f /proc/cpuinfo && echo "AVX-512" || echo "AVX2, no AVX-512")
machine="$(nproc) cores, $isa, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | sed 's/^ //')"
