#!/usr/bin/python3
"""PyTorch and dp training the same model at the same batch on the same cores, side by side.

One run measures, for each model (lenet, lenet5) at batch 256 (SGD lr 0.1 momentum 0.9, cross-entropy,
the same data for both), with every PyTorch of --torch (today's 2.x from the environment
scripts/deps.sh --bench makes, Debian's 1.13 where it still runs):
  1 core : PyTorch with torch.set_num_threads(1), eager and (2.x) torch.compile'd   vs dp_train --gpus 0
  2 cores: PyTorch with 2 threads, eager and compiled, and DDP (gloo, 2 processes on 127.0.0.1, 1 thread
           each)   vs dp_train --devices 2 --sync allreduce, and vs dp's own 1-core figure
  processes (--configs processes): DDP over gloo launched by torchrun --nproc_per_node 2   vs
           mpirun -np 2 dp_train --devices 1 --sync allreduce, with the bytes a step sends across processes
           (dp's measured; PyTorch counts none, so the ring's model of DDP's one bucket of P floats)
and prints images/s (median and range over the rounds), GFLOP/s, the fraction of the cores' FP32 peak,
torch.compile's compilation time apart, and the ratios of the medians against the targets (1 core:
dp >= 75% of the peak and >= 3x each PyTorch's best; 2 cores: dp >= 3x each PyTorch's best and >= 1.9x
dp's 1-core figure).

What is timed is training steps only, as dp_train's images_per_second (which excludes evaluation):
PyTorch runs warm-up steps first (a compiled module compiles in the first, timed apart), then times
whole steps (batch gather, forward, loss, backward, optimizer). Every measurement runs in its own
process (bench/torch_workers.py, with that PyTorch's interpreter); the engines alternate within each
round, so a load that comes and goes hits both. Other processes' CPU use during each measurement is
printed ("bg"), since a shared machine makes any figure low. Nothing is downloaded;
bench/cpu_speed.sh is the usual entry point.
"""

import argparse
import json
import os
import resource
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time

from cpu_peak import peak  # bench/cpu_peak.py, beside this script
from torch_workers import MODELS, build  # bench/torch_workers.py: PyTorch's side, run per interpreter

FASHION = "/usr/share/datasets/fashion-mnist"
# models/model.cpp train_flops_per_sample, asserted in tests/test_fast_kernels.cpp; recomputed below
# from the PyTorch modules and checked against these.
DP_TRAIN_FLOPS = {"lenet": 13258800, "lenet5": 2263920}

# ---- data -----------------------------------------------------------------------------------------


def write_synthetic(directory, train=60000, test=1000, seed=0):
    """Random images and labels as raw IDX files, for both engines (no dataset needed)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    for prefix, n in (("train", train), ("t10k", test)):
        images = rng.integers(0, 256, size=(n, 28, 28), dtype=np.uint8)
        labels = rng.integers(0, 10, size=(n,), dtype=np.uint8)
        with open(os.path.join(directory, f"{prefix}-images-idx3-ubyte"), "wb") as f:
            f.write(struct.pack(">IIII", 0x803, n, 28, 28) + images.tobytes())
        with open(os.path.join(directory, f"{prefix}-labels-idx1-ubyte"), "wb") as f:
            f.write(struct.pack(">II", 0x801, n) + labels.tobytes())


# ---- models and FLOPs -----------------------------------------------------------------------------


def train_flops_per_sample(name):
    """2 FLOPs per multiply-add of the conv and linear layers: forward 1x, weight gradient 1x, data
    gradient 1x except for the first layer (nobody needs the input's gradient). Bias, activations,
    pooling, loss and optimizer are not counted. Counted on the PyTorch module with one forward."""
    import torch
    import torch.nn as nn

    macs = []

    def hook(module, inputs, output):
        if isinstance(module, nn.Conv2d):
            kh, kw = module.kernel_size
            macs.append(output[0].numel() * module.in_channels * kh * kw)
        elif isinstance(module, nn.Linear):
            macs.append(module.in_features * module.out_features)

    net = build(name)
    for m in net.children():  # the hooks fire in forward order: macs[0] is the first layer's
        m.register_forward_hook(hook)
    with torch.no_grad():
        net(torch.zeros(1, 1, 28, 28))
    flops = 2 * (3 * sum(macs) - macs[0])
    if flops != DP_TRAIN_FLOPS[name]:
        raise SystemExit(f"{name}: {flops} training FLOPs per sample here, {DP_TRAIN_FLOPS[name]} in models/model.cpp")
    return flops


# ---- measuring ------------------------------------------------------------------------------------


def busy_seconds():
    """CPU seconds all processes have used (user + nice + system + irq + softirq), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = [int(v) for v in f.readline().split()[1:]]
    return (fields[0] + fields[1] + fields[2] + fields[5] + fields[6]) / os.sysconf("SC_CLK_TCK")


QUIET = {"cores": 0.25, "wait": 0.0}  # from --quiet-below / --quiet-wait


def wait_for_quiet():
    """Waits (up to --quiet-wait seconds) until other processes use less than --quiet-below cores."""
    deadline = time.time() + QUIET["wait"]
    while True:
        b0, t0 = busy_seconds(), time.time()
        time.sleep(1.0)
        used = (busy_seconds() - b0) / (time.time() - t0)
        if used < QUIET["cores"] or time.time() >= deadline:
            return used


def measure(cmd):
    """Runs a measurement process; returns its JSON result and the other processes' CPU use (cores)."""
    if QUIET["wait"] > 0:
        wait_for_quiet()
    ru0, busy0, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), busy_seconds(), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.time() - t0
    ru1, busy1 = resource.getrusage(resource.RUSAGE_CHILDREN), busy_seconds()
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stdout}{proc.stderr}")
    ours = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    background = max(0.0, (busy1 - busy0) - ours) / wall
    return proc.stdout, background


WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "torch_workers.py")


def run_torch(args, python, model, mode, threads, seconds):
    """One PyTorch measurement with interpreter `python`; (img/s, bg, the first step's seconds)."""
    cmd = [python, WORKERS, "--mode", mode, "--model", model, "--threads", str(threads), "--batch", str(args.batch),
           "--data", args.data, "--seconds", str(seconds), "--warmup", str(args.warmup)]
    out, bg = measure(cmd)
    r = json.loads(out.strip().splitlines()[-1])
    return r["images_per_second"], bg, r["compile_s"]


def torch_versions(args):
    """{label: interpreter} for --torch: each interpreter's PyTorch, labelled by its version."""
    found = {}
    for python in args.torch.split(","):
        if not python or not os.access(python, os.X_OK):
            continue
        r = subprocess.run([python, "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
        if r.returncode == 0:
            found[f"PyTorch {r.stdout.strip()}"] = python
    if not found:
        raise SystemExit(f"--torch {args.torch}: no interpreter there imports torch (scripts/deps.sh --bench)")
    return found


# OpenMPI's settings for a small machine on loopback (bench/mpi_common.sh's), as root where we are.
MPI_ENV = {"OMPI_MCA_rmaps_base_oversubscribe": "1", "OMPI_MCA_btl_tcp_if_include": "lo",
           "OMPI_MCA_oob_tcp_if_include": "lo", "OMPI_MCA_mpi_yield_when_idle": "1"}
if os.geteuid() == 0:
    MPI_ENV.update(OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1")
BYTES = {}  # label: bytes a process sends across processes a step (dp's measured, DDP's modelled)


def run_dp_mpi(args, binary, model, seconds, rate_guess, label):
    """mpirun -np 2 dp_train --devices 1 --sync allreduce: (img/s, bg); its bytes across processes in BYTES."""
    steps = max(20, int(seconds * rate_guess / args.batch))
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        cmd = ["mpirun", "-np", "2", binary, "--backend", "cpu", "--devices", "1", "--sync", "allreduce", "--model",
               model, "--batch", str(args.batch), "--steps", str(steps), "--lr", "0.1", "--momentum", "0.9", "--data",
               args.data, "--limit-test", "256", "--report", report, "--quiet"]
        os.environ.update(MPI_ENV)
        _, bg = measure(cmd)
        with open(report) as f:
            r = json.load(f)
        BYTES[label] = r["devices"][0]["inter_process_bytes_sent_per_step"]
        return r["images_per_second"], bg


def run_dp(args, binary, model, devices, seconds, rate_guess):
    steps = max(20, int(seconds * rate_guess / args.batch))
    with tempfile.TemporaryDirectory() as tmp:
        report = os.path.join(tmp, "report.json")
        placement = ["--gpus", "0"] if devices == 1 else ["--devices", str(devices), "--sync", "allreduce"]
        cmd = [binary, "--backend", "cpu", *placement, "--model", model, "--batch", str(args.batch),
               "--steps", str(steps), "--lr", "0.1", "--momentum", "0.9", "--data", args.data, "--limit-test", "256",
               "--report", report, "--quiet"]
        _, bg = measure(cmd)
        with open(report) as f:
            return json.load(f)["images_per_second"], bg


# ---- the comparison -------------------------------------------------------------------------------


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dp-train", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build", "dp_train"),
                   help="the dp_train binary (default: build/dp_train)")
    p.add_argument("--dp-before", help="a second dp_train (e.g. built before a change), measured in the same rounds")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--data", default=FASHION if os.path.isdir(FASHION) else None,
                   help=f"IDX directory (default {FASHION}); --synthetic for random data")
    p.add_argument("--synthetic", action="store_true", help="random images and labels instead of a dataset")
    p.add_argument("--seconds", type=float, default=12.0, help="timed seconds per measurement")
    p.add_argument("--repeats", type=int, default=3, help="rounds; the median, best and range of each are printed")
    p.add_argument("--configs", default="1core,2core",
                   help="any of 1core, 2core, processes (torchrun DDP against mpirun dp_train), comma-separated")
    p.add_argument("--warmup", type=int, default=10, help="PyTorch steps before timing (twice: warm, then pace)")
    p.add_argument("--clock-ghz", type=float, help="the cores' clock for the peak (default: cpufreq, else a probe)")
    p.add_argument("--flops-per-cycle", type=int, default=32, help="FP32 FLOP per cycle per core (Zen 4: 32)")
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="before each measurement wait up to this many seconds for the other processes to go quiet")
    p.add_argument("--quiet-below", type=float, default=0.25, help="quiet: others use fewer cores than this")
    p.add_argument("--json", help="also write the results here")
    here = os.path.dirname(os.path.abspath(__file__))
    p.add_argument("--torch", default=os.path.join(here, "..", ".venv-bench", "bin", "python") + ",/usr/bin/python3",
                   help="the interpreters whose PyTorch is measured, comma-separated; those that import torch are "
                        "used (default: scripts/deps.sh --bench's environment, then Debian's)")
    p.add_argument("--compile-max", action="store_true",
                   help='also torch.compile(mode="max-autotune-no-cudagraphs") (PyTorch 2; its compilation takes minutes)')
    return p.parse_args()


def runs_for(args, model, binaries, configs, pytorches):
    """(label, cores, runner) per measurement; a runner takes a rate guess (dp needs a step count) and
    returns (img/s, bg, compile s or None)."""
    runs = []
    for cores, config in ((1, "1core"), (2, "2core")):
        if config not in configs:
            continue
        for label, python in pytorches.items():
            modes = ["eager"]
            if not label.startswith("PyTorch 1."):
                modes += ["compile"] + (["compile-max"] if args.compile_max else [])
            for mode in modes:
                what = {"eager": "", "compile": " compile", "compile-max": " compile max-autotune"}[mode]
                runs.append((f"{label}{what} {cores} thread{'s' * (cores > 1)}", cores,
                             lambda g, p=python, m=mode, c=cores: run_torch(args, p, model, m, c, args.seconds)))
            if cores == 2:
                runs.append((f"{label} DDP gloo 2 x 1 thread", 2,
                             lambda g, p=python: run_torch(args, p, model, "ddp", 1, args.seconds)))
        for name, b in binaries.items():
            what = "1 device x 1 thread" if cores == 1 else "2 devices x 1 thread allreduce"
            runs.append((f"{name} {what}", cores, lambda g, b=b, c=cores: (*run_dp(args, b, model, c, args.seconds, g), None)))
    if "processes" in configs:
        params = sum(p.numel() for p in build(model).parameters())
        for label, python in pytorches.items():
            if label.startswith("PyTorch 1."):
                # Debian's 1.13 under Python 3.11: torchrun's elastic agent fails to start its workers
                # (multiprocessing/api.py to_map: 'NoneType' object has no attribute 'get'); its DDP
                # runs in the 2-core rows, started by torch.multiprocessing.spawn.
                print(f"  {label}: no torchrun row (its torchrun fails to start workers under Debian's Python 3.11); "
                      "its DDP is in the 2-core rows")
                continue
            what = f"{label} DDP gloo torchrun 2 x 1 thread"
            BYTES[what] = 4 * params  # a ring all-reduce of P floats over 2 ranks: P floats out (and in) each
            runs.append((what, 2, lambda g, p=python: run_torch(args, p, model, "torchrun", 1, args.seconds)))
        for name, b in binaries.items():
            what = f"{name} mpirun 2 x 1 device allreduce"
            runs.append((what, 2, lambda g, b=b, w=what: (*run_dp_mpi(args, b, model, args.seconds, g, w), None)))
    return runs


def measure_rounds(args, runs):
    """--repeats rounds, the engines alternating within each; {label: [(img/s, bg, compile s) per round]}."""
    guess = {label: 5000.0 for label, _, _ in runs}
    samples = {label: [] for label, _, _ in runs}
    for rnd in range(args.repeats):
        for label, cores, runner in runs:
            if label.startswith("dp") and rnd == 0:  # a short run sets the step count for ~seconds
                guess[label] = runner(guess[label] * 2 / args.seconds)[0]
            rate, bg, compile_s = runner(guess[label])
            guess[label] = max(guess[label], rate)
            samples[label].append((rate, bg, compile_s))
            print(f"  round {rnd + 1}  {label:<48} {rate:10,.0f} img/s   (bg {bg:.2f} cores)", flush=True)
    return samples


def print_ratios(med, cores_of, binaries, configs, pytorches, flops, core_peak):
    """The ratios of the medians against the targets, each against every PyTorch's best configuration on
    those cores (and dp against dp-before), printed; returns them by name."""
    ratios = {}

    def verdict(r, target):
        return "met" if r >= target else f"NOT met ({100 * r / target:.0f}% of the target)"

    def ratio(name, num, den, target):
        r = med[num] / med[den]
        ratios[name] = r
        print(f"  {name:<72} {r:5.2f}x  (target {target}x: {verdict(r, target)})")

    print()
    for name in binaries:
        for cores, config, dp_label in ((1, "1core", f"{name} 1 device x 1 thread"),
                                        (2, "2core", f"{name} 2 devices x 1 thread allreduce")):
            if config not in configs:
                continue
            if cores == 1:
                share = med[dp_label] * flops / 1e9 / core_peak
                print(f"  {'1 core : ' + name + ' 1 device, share of the peak':<72} {100 * share:5.1f}%  "
                      f"(target 75%: {verdict(share, 0.75)})")
            for version in pytorches:
                theirs = [k for k in med if k.startswith(version + " ") and cores_of[k] == cores]
                best = max(theirs, key=lambda k: med[k])
                ratio(f"{cores} core{'s' * (cores > 1)}{' ' * (cores == 1)}: {name} / {best}", dp_label, best, 3)
            if cores == 2 and "1core" in configs:
                ratio(f"2 cores: {name} 2 devices / {name} 1 device", dp_label, f"{name} 1 device x 1 thread", 1.9)
    if "processes" in configs:
        for name in binaries:
            for version in (v for v in pytorches if not v.startswith("PyTorch 1.")):
                ratio(f"processes: {name} mpirun / {version} torchrun DDP", f"{name} mpirun 2 x 1 device allreduce",
                      f"{version} DDP gloo torchrun 2 x 1 thread", 3)
    if "dp-before" in binaries:
        for cfg in ("1 device x 1 thread", "2 devices x 1 thread allreduce"):
            if f"dp {cfg}" in med:
                ratios[f"dp / dp-before, {cfg}"] = med[f"dp {cfg}"] / med[f"dp-before {cfg}"]
                print(f"  {'after / before, ' + cfg:<72} {ratios[f'dp / dp-before, {cfg}']:5.2f}x")
    return ratios


def compare_model(args, model, binaries, configs, pytorches, core_peak):
    """One model's measurements, table and ratios; returns its part of --json."""
    flops = train_flops_per_sample(model)
    print(f"\n{model}: {flops:,} training FLOPs per sample (2 per multiply-add: forward, weight gradient, "
          f"data gradient except the first layer's; = models/model.cpp train_flops_per_sample)")
    runs = runs_for(args, model, binaries, configs, pytorches)
    samples = measure_rounds(args, runs)
    rates = {label: sorted(r for r, _, _ in s) for label, s in samples.items()}
    med = {label: statistics.median(r) for label, r in rates.items()}
    result = {"flops_per_sample": flops, "median": med, "best": {k: r[-1] for k, r in rates.items()},
              "samples": {k: [{"images_per_second": r, "background_cores": b, "compile_s": c} for r, b, c in v]
                          for k, v in samples.items()}}
    print(f"\n  {model:<8} {'configuration':<48} {'median img/s':>12} {'min - max':>17} {'GFLOP/s':>8} "
          f"{'% peak':>7} {'compile s':>9}")
    for label, cores, _ in runs:
        gflops = med[label] * flops / 1e9
        compiled = [c for _, _, c in samples[label] if c is not None and "compile" in label]
        print(f"  {'':<8} {label:<48} {med[label]:12,.0f} {rates[label][0]:8,.0f} - {rates[label][-1]:6,.0f} "
              f"{gflops:8.1f} {100 * gflops / (cores * core_peak):6.1f}% "
              f"{statistics.median(compiled) if compiled else float('nan'):9.1f}".replace(" nan", "    "))
    for label, _, _ in runs:
        if label in BYTES:
            how = "measured (its report)" if "mpirun" in label else "PyTorch counts none: the ring's model of P floats"
            print(f"  {'':<8} {label:<48} {BYTES[label]:12,} B a step to the other process, {how}")
    result["bytes_across_processes"] = {k: v for k, v in BYTES.items() if k in med}
    cores_of = {label: cores for label, cores, _ in runs}
    result["ratios"] = print_ratios(med, cores_of, binaries, configs, pytorches, flops, core_peak)
    return result


def main():
    args = parse_args()
    QUIET["cores"], QUIET["wait"] = args.quiet_below, args.quiet_wait

    tmp = None
    if args.synthetic or not args.data:
        tmp = tempfile.mkdtemp(prefix="dp-synthetic-")
        write_synthetic(tmp)
        args.data, data_name = tmp, "synthetic (random 28x28 images, 60000 train)"
    else:
        data_name = args.data
    binaries = {"dp": os.path.abspath(args.dp_train)}
    if args.dp_before:
        binaries["dp-before"] = os.path.abspath(args.dp_before)
    for b in binaries.values():
        if not os.access(b, os.X_OK):
            raise SystemExit(f"{b}: not an executable dp_train (build it, or pass --dp-train)")
    pytorches = torch_versions(args)
    if os.environ.get("DP_CPU_KERNELS") == "avx2":  # both engines on AVX2 (bench/cpu_peak.py says so)
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    core_peak, peak_text = peak(args)
    print(f"{', '.join(f'{v} ({p})' for v, p in pytorches.items())}; dp: {', '.join(binaries.values())}")
    print(peak_text)
    print(f"data: {data_name}; batch {args.batch}; SGD lr 0.1 momentum 0.9; ~{args.seconds:.0f} s timed per measurement; "
          f"{args.repeats} rounds, the engines alternating within each; medians (ratios of medians), the range, and "
          f"torch.compile's first step (its compilation) apart")
    configs = args.configs.split(",")
    results = {}
    for model in args.models.split(","):
        results[model] = compare_model(args, model, binaries, configs, pytorches, core_peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gflops_per_core": core_peak, "peak": peak_text, "data": data_name, "batch": args.batch,
                       "pytorch": pytorches, "models": results}, f, indent=2)
    if tmp:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
