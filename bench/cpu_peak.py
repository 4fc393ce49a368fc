"""The FP32 peak of one core of this machine, for bench/torch_compare.py's "fraction of peak".

From cpufreq's maximum clock where the kernel exposes it, else from a short FMA-throughput probe
compiled here, else from /proc/cpuinfo's clock; the sentence returned with the figure says which.
"""

import os
import shutil
import subprocess
import tempfile

# ---- the machine's peak ---------------------------------------------------------------------------

FMA_PROBE = r"""
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
#ifdef __AVX512F__
typedef __m512 V;
#define SET _mm512_set1_ps
#define FMA _mm512_fmadd_ps
#define W 16
#else
typedef __m256 V;
#define SET _mm256_set1_ps
#define FMA _mm256_fmadd_ps
#define W 8
#endif
int main(void) {
  V a0 = SET(0), a1 = SET(1), a2 = SET(2), a3 = SET(3), a4 = SET(4), a5 = SET(5), a6 = SET(6), a7 = SET(7),
    a8 = SET(8), a9 = SET(9), b = SET(0.999f), c = SET(1e-4f);
  long n = 0;
  double t = now();
  while (now() - t < 1.0) {
    for (int k = 0; k < 100000; ++k) {
      a0 = FMA(a0, b, c); a1 = FMA(a1, b, c); a2 = FMA(a2, b, c); a3 = FMA(a3, b, c); a4 = FMA(a4, b, c);
      a5 = FMA(a5, b, c); a6 = FMA(a6, b, c); a7 = FMA(a7, b, c); a8 = FMA(a8, b, c); a9 = FMA(a9, b, c);
      __asm__ volatile("" : "+x"(a0), "+x"(a1), "+x"(a2), "+x"(a3), "+x"(a4), "+x"(a5), "+x"(a6), "+x"(a7), "+x"(a8), "+x"(a9));
    }
    n += 100000;
  }
  printf("%f\n", n * 10.0 * W * 2 / (now() - t) / 1e9);
  return 0;
}
"""


def cpu_info():
    info = {"model": "unknown", "flags": set(), "mhz": None}
    with open("/proc/cpuinfo") as f:
        for line in f:
            key, _, value = line.partition(":")
            key, value = key.strip(), value.strip()
            if key == "model name" and info["model"] == "unknown":
                info["model"] = value
            elif key == "flags" and not info["flags"]:
                info["flags"] = set(value.split())
            elif key == "cpu MHz" and info["mhz"] is None:
                info["mhz"] = float(value)
            elif key == "cpu family":
                info.setdefault("family", int(value))
    try:
        with open("/sys/devices/system/cpu/cpu0/cpufreq/cpuinfo_max_freq") as f:
            info["max_mhz"] = int(f.read()) / 1000
    except OSError:
        info["max_mhz"] = None
    return info


def fma_probe(avx512):
    """GFLOP/s of one core running independent FMA chains (10 accumulators), or None without a compiler."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return None
    with tempfile.TemporaryDirectory() as tmp:
        src, exe = os.path.join(tmp, "probe.c"), os.path.join(tmp, "probe")
        with open(src, "w") as f:
            f.write(FMA_PROBE)
        isa = ["-mavx512f"] if avx512 else ["-mavx2", "-mfma"]
        if subprocess.run([cc, "-O2", *isa, src, "-o", exe], capture_output=True).returncode != 0:
            return None
        best = 0.0
        for _ in range(3):
            out = subprocess.run(["taskset", "-c", "0", exe] if shutil.which("taskset") else [exe],
                                 capture_output=True, text=True)
            if out.returncode == 0:
                best = max(best, float(out.stdout))
        return best or None


def peak(args):
    """Per-core FP32 peak in GFLOP/s and the sentence that states how it was obtained."""
    info = cpu_info()
    # DP_CPU_KERNELS=avx2 on an AVX-512 machine: dp runs its AVX2 kernels (and torch_compare.py keeps
    # PyTorch to AVX2), so the peak is AVX2's.
    avx2_only = os.environ.get("DP_CPU_KERNELS") == "avx2"
    avx512 = "avx512f" in info["flags"] and not avx2_only
    fpc = args.flops_per_cycle
    isa = 'AVX-512' if avx512 else 'AVX2' if 'avx2' in info['flags'] else 'no AVX2'
    if avx2_only and "avx512f" in info["flags"]:
        isa = "AVX-512, run as AVX2: DP_CPU_KERNELS=avx2, PyTorch's ATEN_CPU_CAPABILITY=avx2 and ONEDNN_MAX_CPU_ISA=AVX2"
    cpu = f"CPU: {info['model']} ({os.cpu_count()} cores visible, {isa}); "
    probe = None if args.clock_ghz or info["max_mhz"] else fma_probe(avx512)
    if probe:  # measured: no FLOP/cycle or clock to assume (they differ by vendor and vector width)
        return probe, (cpu + f"peak = an FMA-throughput probe with {'AVX-512' if avx512 else 'AVX2'}, independent chains "
                       f"on one core: {probe:.1f} GFLOP/s per core (no cpufreq here; /proc/cpuinfo says {info['mhz']:.0f} MHz)")
    if args.clock_ghz:
        ghz, source = args.clock_ghz, "--clock-ghz"
    elif info["max_mhz"]:
        ghz, source = info["max_mhz"] / 1000, "cpufreq cpuinfo_max_freq"
    else:
        ghz, source = info["mhz"] / 1000, "/proc/cpuinfo 'cpu MHz' (no cpufreq, no compiler for a probe)"
    text = (cpu + f"peak assumed {fpc} FP32 FLOP/cycle/core (--flops-per-cycle; Zen 4: two 256-bit FMA pipes, AVX-512 "
            f"double-pumped, the same for AVX2 FMA) at {ghz:.2f} GHz from {source} = {fpc * ghz:.1f} GFLOP/s per core")
    return fpc * ghz, text
