#!/usr/bin/env bash
# Gathers what a GPU machine without our Debian packages and without network needs to build, test
# and train dp, for scripts/gpu_check.sh to use there. Run it here (Debian 12, apt access):
#   DIR/prefix/usr/...      the build dependencies, unpacked from their .deb files (dpkg-deb -x, never
#                           into /): BLIS (libblis-serial-dev, libblis4-serial), zlib (zlib1g-dev,
#                           zlib1g), doctest-dev, libcli11-dev, nlohmann-json3-dev
#   DIR/fashion-mnist/      the gzip'd IDX files of Fashion-MNIST (dataset-fashion-mnist)
#   DIR/MANIFEST            package names and versions, the data files' sha256, the size
# What dp never uses is left out, to stay under the budget (60 MiB: the device tool carries 64 MiB,
# the repository included): the packages' docs and man pages, and BLIS's shared libraries (dp links
# libblis.a statically; CMakeLists.txt), which alone are 24 MiB.
#
# Usage: scripts/gpu_kit.sh [DIR]      (default: gpu-kit/ in the repository, git-ignored)
# Exits 1, saying why, when a package cannot be downloaded or the kit is over 60 MiB.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
dir=${1:-$here/gpu-kit}
case "$dir" in -h | --help) sed -n '2,15p' "$0"; exit 0 ;; esac
limit_mib=60
pkgs=(libblis-serial-dev libblis4-serial zlib1g-dev zlib1g doctest-dev libcli11-dev nlohmann-json3-dev)
data_pkg=dataset-fashion-mnist
data_src=/usr/share/datasets/fashion-mnist
data_files=(train-images-idx3-ubyte.gz train-labels-idx1-ubyte.gz t10k-images-idx3-ubyte.gz t10k-labels-idx1-ubyte.gz)

die() { echo "gpu_kit.sh: $*" >&2; exit 1; }
for tool in apt-get dpkg-deb sha256sum; do command -v "$tool" > /dev/null || die "$tool not found (run this on Debian)"; done
[ -e "$dir" ] && [ ! -d "$dir" ] && die "$dir exists and is not a directory"
[ -d "$dir" ] && [ -n "$(ls -A "$dir")" ] && [ ! -f "$dir/MANIFEST" ] &&
  die "$dir is not empty and holds no MANIFEST: not a kit, left alone"
rm -rf "$dir"
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
debs=$(mktemp -d)
trap 'rm -rf "$debs"' EXIT
chmod 755 "$debs"  # apt's _apt user writes the download when it can (else apt warns and downloads as root)

# The installed version where a package is installed (what a build here uses), else the candidate.
want() {
  local v
  v=$(dpkg-query -W -f='${Status} ${Version}' "$1" 2> /dev/null | sed -n 's/^install ok installed //p')
  if [ -n "$v" ]; then echo "$1=$v"; else echo "$1"; fi
}
download() {  # package names, into $debs; an apt-get update once if the lists do not know them
  local specs=() p
  for p in "$@"; do specs+=("$(want "$p")"); done
  if ! (cd "$debs" && apt-get download -q "${specs[@]}" > "$debs/apt.log" 2>&1) &&
     ! (cd "$debs" && apt-get download -q "$@" > "$debs/apt.log" 2>&1); then
    echo "gpu_kit.sh: apt-get download failed; running apt-get update once" >&2
    apt-get update -q > /dev/null || die "apt-get update failed (run as root, or with network)"
    (cd "$debs" && apt-get download -q "$@" > "$debs/apt.log" 2>&1) || { cat "$debs/apt.log" >&2; die "apt-get download $* failed"; }
  fi
}

download "${pkgs[@]}"
mkdir -p "$dir/prefix"
{
  echo "# dp GPU kit, made $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME") ($(uname -m)) by scripts/gpu_kit.sh"
  echo "# repository commit $(git -C "$here" rev-parse --short HEAD 2> /dev/null || echo unknown)"
  echo "# package version architecture (unpacked into prefix/)"
} > "$dir/MANIFEST"
for p in "${pkgs[@]}"; do
  deb=$(ls "$debs/${p}"_*.deb 2> /dev/null | head -1)
  [ -n "$deb" ] || die "no .deb for $p after apt-get download"
  dpkg-deb -x "$deb" "$dir/prefix"
  dpkg-deb -f "$deb" Package Version Architecture | tr '\n' ' ' | sed 's/Package: //; s/ Version: / /; s/ Architecture: / /; s/ *$/\n/' >> "$dir/MANIFEST"
done
# Left out: documentation, and BLIS's shared libraries (with the links to them, which would dangle).
rm -rf "$dir/prefix/usr/share/doc" "$dir/prefix/usr/share/man" "$dir/prefix/usr/share/lintian"
find "$dir/prefix" -path '*/blis-serial/*' \( -name 'libblis.so*' -o -name 'libblas.so*' \) -delete
echo "# left out: usr/share/{doc,man,lintian}; blis-serial's libblis.so* and libblas.so* (dp links libblis.a)" >> "$dir/MANIFEST"

# The data set: the installed files, else those of the package.
mkdir -p "$dir/fashion-mnist"
if [ ! -f "$data_src/${data_files[0]}" ]; then
  download "$data_pkg"
  deb=$(ls "$debs/${data_pkg}"_*.deb | head -1)
  dpkg-deb -x "$deb" "$debs/data"
  data_src=$debs/data/usr/share/datasets/fashion-mnist
  data_version=$(dpkg-deb -f "$deb" Version)
else
  data_version=$(dpkg-query -W -f='${Version}' "$data_pkg" 2> /dev/null || echo "unknown (not from a package)")
fi
for f in "${data_files[@]}"; do
  [ -f "$data_src/$f" ] || die "$data_src/$f not found"
  cp "$data_src/$f" "$dir/fashion-mnist/"
done
echo "$data_pkg $data_version all (fashion-mnist/: ${data_files[*]})" >> "$dir/MANIFEST"
(cd "$dir/fashion-mnist" && sha256sum "${data_files[@]}") | sed 's/^/# sha256 /' >> "$dir/MANIFEST"

bytes=$(du -sb "$dir" | cut -f1)
mib=$(awk -v b="$bytes" 'BEGIN { printf "%.1f", b / 1048576 }')
echo "# size: $bytes bytes ($mib MiB; limit $limit_mib MiB)" >> "$dir/MANIFEST"
du -sh "$dir/prefix" "$dir/fashion-mnist" | sed 's/^/  /'
if [ "$bytes" -gt $((limit_mib * 1048576)) ]; then
  die "$dir is $mib MiB, past the $limit_mib MiB limit (the device tool carries 64 MiB with the repository)"
fi
echo "gpu_kit.sh: $dir: $mib MiB (limit $limit_mib MiB); $(grep -vc '^#' "$dir/MANIFEST") packages, see $dir/MANIFEST"
echo "on the GPU machine, from the repository root: scripts/gpu_check.sh --kit ${dir#"$here"/}"
