# Sourced by scripts/gpu_check.sh (after it picked $py, a Python that has torch): where cuDNN and NCCL are
# on a GPU machine without our Debian packages.
# shellcheck shell=bash disable=SC2154  # $py: set by gpu_check.sh before it sources this

# cuDNN and NCCL: where the toolkit has them, else PyTorch's wheels (nvidia-cudnn-cu*, nvidia-nccl-cu*:
# site-packages/nvidia/{cudnn,nccl}/{include,lib}, whose libraries carry only the versioned name
# libcudnn.so.9, so CMake's find_library would miss them: the full paths go in as cache variables).
wheel_dirs() {  # module (cudnn|nccl): the wheel's folders, then every nvidia/* folder
  "$py" - "$1" 2> /dev/null << 'EOF'
import importlib, sys
for name in ("nvidia." + sys.argv[1], "nvidia"):
    try:
        for p in importlib.import_module(name).__path__:
            print(p)
    except Exception:
        pass
EOF
}
in_root() {  # root name -> "LIBRARY<TAB>INCLUDE_DIR" when this one folder has both
  local root=$1 name=$2 lib="" inc="" f
  for f in "$root"/lib64/lib$name.so "$root"/lib/lib$name.so "$root"/lib/x86_64-linux-gnu/lib$name.so \
           "$root"/lib64/lib$name.so.[0-9]* "$root"/lib/lib$name.so.[0-9]* "$root"/lib/x86_64-linux-gnu/lib$name.so.[0-9]*; do
    [ -e "$f" ] && { lib=$f; break; }
  done
  [ -f "$root/include/$name.h" ] && inc=$root/include
  [ -z "$inc" ] && [ -f "$root/include/x86_64-linux-gnu/$name.h" ] && inc=$root/include/x86_64-linux-gnu
  if [ -z "$lib" ] || [ -z "$inc" ]; then  # a wheel of another layout (nvidia/cu13/...): look deeper
    [ -z "$lib" ] && lib=$(find "$root" -maxdepth 4 -name "lib$name.so*" 2> /dev/null | sort | head -1)
    [ -z "$inc" ] && inc=$(find "$root" -maxdepth 4 -name "$name.h" -printf '%h\n' 2> /dev/null | head -1)
  fi
  [ -n "$lib" ] && [ -n "$inc" ] && printf '%s\t%s\n' "$lib" "$inc"
}
# A library and the header it was built with, from one folder: a header of one version with the
# library of another compiles and then fails, or misbehaves, at run time (gpu_check's env step compares
# the two versions). The toolkit's folders first, then the wheels'.
find_dep() {  # name (cudnn|nccl) -> "LIBRARY<TAB>INCLUDE_DIR", empty when no folder has both
  local name=$1 root found wheels=()
  local fixed=(${CUDA_HOME:+"$CUDA_HOME"} /usr/local/cuda /usr/local/cuda/targets/x86_64-linux /usr)
  mapfile -t wheels < <(wheel_dirs "$name")
  for root in "${fixed[@]}" "${wheels[@]}"; do
    [ -d "$root" ] || continue
    [ "$root" = /usr ] && [ ! -f /usr/include/$name.h ] && [ ! -f /usr/include/x86_64-linux-gnu/$name.h ] && continue
    found=$(in_root "$root" "$name") && { echo "$found"; return 0; }
  done
  return 0
}
# The version a library reports (cudnnGetVersion, ncclGetVersion), as major*10000 + minor*100 + patch.
lib_version() {  # name (cudnn|nccl) library
  "$py" - "$1" "$2" 2> /dev/null << 'EOF'
import ctypes, sys
name, path = sys.argv[1:]
lib = ctypes.CDLL(path)
if name == "cudnn":
    lib.cudnnGetVersion.restype = ctypes.c_size_t
    print(lib.cudnnGetVersion())
else:
    v = ctypes.c_int()
    lib.ncclGetVersion(ctypes.byref(v))
    print(v.value)
EOF
}
# The version a header declares, the same way.
header_version() {  # name (cudnn|nccl) include-dir
  local d=$2
  if [ "$1" = cudnn ]; then
    awk '/#define CUDNN_MAJOR /{a=$3} /#define CUDNN_MINOR /{b=$3} /#define CUDNN_PATCHLEVEL /{c=$3} END { if (a != "") print a * 10000 + b * 100 + c }' "$d"/cudnn_version.h "$d"/cudnn.h 2> /dev/null
  else
    awk '/#define NCCL_MAJOR /{a=$3} /#define NCCL_MINOR /{b=$3} /#define NCCL_PATCH /{c=$3} END { if (a != "") print a * 10000 + b * 100 + c }' "$d"/nccl.h 2> /dev/null
  fi
}
