# Sourced by scripts/gpu_check.sh (after it picked $py, a Python that has torch): where cuDNN and NCCL are
# on a GPU machine without our Debian packages.
# shellcheck shell=bash

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
find_dep() {  # name (cudnn|nccl) -> "LIBRARY<TAB>INCLUDE_DIR", empty when not found
  local name=$1 root lib="" inc="" f
  local fixed=(${CUDA_HOME:+"$CUDA_HOME"} /usr/local/cuda /usr/local/cuda/targets/x86_64-linux /usr) wheels=()
  mapfile -t wheels < <(wheel_dirs "$name")
  for root in "${fixed[@]}" "${wheels[@]}"; do
    [ -d "$root" ] || continue
    if [ -z "$lib" ]; then
      for f in "$root"/lib64/lib$name.so "$root"/lib/lib$name.so "$root"/lib/x86_64-linux-gnu/lib$name.so \
               "$root"/lib64/lib$name.so.[0-9]* "$root"/lib/lib$name.so.[0-9]* "$root"/lib/x86_64-linux-gnu/lib$name.so.[0-9]*; do
        [ -e "$f" ] && { lib=$f; break; }
      done
    fi
    [ -z "$inc" ] && [ -f "$root/include/$name.h" ] && inc=$root/include
    [ -z "$inc" ] && [ -f "$root/include/x86_64-linux-gnu/$name.h" ] && inc=$root/include/x86_64-linux-gnu
  done
  if [ -z "$lib" ] || [ -z "$inc" ]; then  # a wheel of another layout (nvidia/cu13/...): look deeper
    for root in "${wheels[@]}"; do
      [ -z "$lib" ] && lib=$(find "$root" -maxdepth 4 -name "lib$name.so*" 2> /dev/null | sort | head -1)
      [ -z "$inc" ] && inc=$(find "$root" -maxdepth 4 -name "$name.h" -printf '%h\n' 2> /dev/null | head -1)
    done
  fi
  [ -n "$lib" ] && [ -n "$inc" ] && printf '%s\t%s\n' "$lib" "$inc"
}
