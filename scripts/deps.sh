#!/usr/bin/env bash
# Installs the Debian packages dp needs to build, train and test, if any is missing.
# Usage: scripts/deps.sh [--bench]   (--bench adds Debian's PyTorch 1.13 and matplotlib for bench/
#                                     comparisons, pandas for reading --log as docs/dp_train.md does,
#                                     and .venv-bench: today's PyTorch from PyPI, pinned, ~4 GB with
#                                     its CUDA libraries, the yardstick of bench/cpu_speed.sh)
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
pkgs=(cmake g++ make pkg-config libblis-serial-dev zlib1g-dev doctest-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist
      libopenmpi-dev openmpi-bin
      clang libclang-rt-dev clang-format clang-tidy shellcheck)
bench=false
if [ "${1:-}" = "--bench" ]; then bench=true; pkgs+=(python3-torch python3-matplotlib python3-pandas python3-venv); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "installing: ${missing[*]}"
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
$bench || exit 0
# The bench's PyTorch 2.x, pinned (git-ignored; bench/cpu_speed.sh takes it when present).
torch=2.15.0 numpy=2.3.5
venv=$here/.venv-bench
"$venv/bin/python" -c "import sys, torch, numpy; sys.exit(torch.__version__ != '$torch' or numpy.__version__ != '$numpy')" \
  2> /dev/null && exit 0
echo "making $venv: torch $torch, numpy $numpy from PyPI"
/usr/bin/python3 -m venv "$venv"
"$venv/bin/pip" install -q "torch==$torch" "numpy==$numpy"
