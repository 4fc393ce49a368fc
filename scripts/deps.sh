#!/usr/bin/env bash
# Installs the Debian packages dp needs to build, train and test, if any is missing.
# Usage: scripts/deps.sh [--bench]   (--bench adds PyTorch and matplotlib for bench/ comparisons, and
#                                     pandas for reading --log as docs/dp_train.md does)
set -euo pipefail
pkgs=(cmake g++ make pkg-config libblis-serial-dev zlib1g-dev doctest-dev libcli11-dev nlohmann-json3-dev dataset-fashion-mnist
      libopenmpi-dev openmpi-bin
      clang libclang-rt-dev clang-format clang-tidy)
if [ "${1:-}" = "--bench" ]; then pkgs+=(python3-torch python3-matplotlib python3-pandas); fi
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
[ ${#missing[@]} -eq 0 ] && exit 0
echo "installing: ${missing[*]}"
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
