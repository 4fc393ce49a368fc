#!/usr/bin/python3
"""PyTorch and dp training the same model at the same batch on the same cores, side by side.

One run measures, for each model (lenet, lenet5) at batch 256 (SGD lr 0.1 momentum 0.9, cross-entropy,
the same data for both):
  1 core : PyTorch with torch.set_num_threads(1)       vs dp_train --gpus 0
  2 cores: PyTorch's better of 2 threads and DDP (gloo, 2 processes on 127.0.0.1, 1 thread each)
           vs dp_train --devices 2 --sync allreduce, and vs dp's own 1-core figure
and prints images/s, GFLOP/s, the fraction of the cores' FP32 peak and the ratios against the targets
(1 core: dp >= 75% of the peak and >= 3x PyTorch; 2 cores: dp >= 3x PyTorch's best and >= 1.9x dp's
1-core figure).

What is timed is training steps only, as dp_train's images_per_second (which excludes evaluation):
PyTorch runs warm-up steps first, then times whole steps (batch gather, forward, loss, backward,
optimizer). Every measurement runs in its own process; the engines alternate within each round, so
a load that comes and goes hits both; the best of --repeats rounds is kept for each. Other processes'
CPU use during each measurement is printed ("bg"), since a shared machine makes any figure low.

Run with Debian's /usr/bin/python3 (torch 1.13); nothing is downloaded. bench/cpu_speed.sh is the
usual entry point.
"""

import argparse
import gzip
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time

from cpu_peak import peak  # bench/cpu_peak.py, beside this script

MODELS = ("lenet", "lenet5")
FASHION = "/usr/share/datasets/fashion-mnist"
# models/model.cpp train_flops_per_sample, asserted in tests/test_fast_kernels.cpp; recomputed below
# from the PyTorch modules and checked against these.
DP_TRAIN_FLOPS = {"lenet": 13258800, "lenet5": 2263920}

# ---- data -----------------------------------------------------------------------------------------


def read_idx(path):
    """An IDX file (gzip'd or raw) as (dims, bytes)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        data = f.read()
    ndim = data[3]
    dims = struct.unpack(">" + "I" * ndim, data[4 : 4 + 4 * ndim])
    return dims, data[4 + 4 * ndim :]


def find_idx(directory, stem):
    for name in (stem + ".gz", stem):
        if os.path.exists(os.path.join(directory, name)):
            return os.path.join(directory, name)
    raise SystemExit(f"{directory}: no {stem}[.gz]")


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


def load_train(directory):
    """The training set as dp reads it (train/data.cpp): pixels / 255 as float, labels as classes."""
    import numpy as np
    import torch

    dims, pixels = read_idx(find_idx(directory, "train-images-idx3-ubyte"))
    _, labels = read_idx(find_idx(directory, "train-labels-idx1-ubyte"))
    x = torch.from_numpy(np.frombuffer(pixels, dtype=np.uint8).astype(np.float32) / 255.0)
    y = torch.from_numpy(np.frombuffer(labels, dtype=np.uint8).astype(np.int64))
    return x.reshape(dims[0], 1, dims[1], dims[2]), y


# ---- models and FLOPs -----------------------------------------------------------------------------


def build(name):
    """models/model.cpp's layers as a torch.nn module (bench/torch_models.py), for the models compared here."""
    import torch_models  # beside this script; imported here, as torch is, so that --help needs neither

    if name not in MODELS:
        raise SystemExit(f"unknown model {name}")
    return torch_models.MODELS[name]()


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


# ---- PyTorch workers (each measurement in a fresh process) ----------------------------------------


def torch_loop(name, batch, x, y, seconds, warmup, rank=0, world=1, wrap=None, agree_steps=None):
    """Trains with a DistributedSampler-like slice per rank; returns (steps, seconds) of the timed part."""
    import torch

    torch.manual_seed(0)
    net = build(name)
    if wrap:
        net = wrap(net)
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    n, local = x.shape[0], batch // world
    gen = torch.Generator().manual_seed(1)
    state = {"perm": torch.randperm(n, generator=gen), "pos": 0}

    def step():
        if state["pos"] + batch > n:
            state["perm"], state["pos"] = torch.randperm(n, generator=gen), 0
        idx = state["perm"][state["pos"] + rank * local : state["pos"] + (rank + 1) * local]
        state["pos"] += batch
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        opt.zero_grad()
        loss = loss_fn(net(xb), yb)
        loss.backward()
        opt.step()

    for _ in range(warmup):
        step()
    t = time.perf_counter()
    for _ in range(warmup):
        step()
    per_step = (time.perf_counter() - t) / warmup
    steps = max(10, int(seconds / per_step))
    if agree_steps:
        steps = agree_steps(steps)  # every DDP rank runs the same number of steps
    t = time.perf_counter()
    for _ in range(steps):
        step()
    return steps, time.perf_counter() - t


def ddp_rank(rank, world, port, args, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = load_train(args.data)

    def agree(steps):
        t = torch.tensor([steps])
        dist.broadcast(t, 0)
        return int(t.item())

    dist.barrier()
    steps, seconds = torch_loop(args.model, args.batch, x, y, args.seconds, args.warmup, rank, world,
                                wrap=DistributedDataParallel, agree_steps=agree)
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump({"images_per_second": steps * args.batch / seconds, "steps": steps, "seconds": seconds}, f)
    dist.destroy_process_group()


def worker(args):
    """--worker torch|ddp: one PyTorch measurement; prints JSON."""
    import torch

    if args.worker == "torch":
        torch.set_num_threads(args.threads)
        x, y = load_train(args.data)
        steps, seconds = torch_loop(args.model, args.batch, x, y, args.seconds, args.warmup)
        print(json.dumps({"images_per_second": steps * args.batch / seconds, "steps": steps, "seconds": seconds}))
        return
    import socket
    import torch.multiprocessing as mp

    with socket.socket() as s:  # a free port on localhost
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        mp.spawn(ddp_rank, args=(2, port, args, out), nprocs=2, join=True)
        with open(out) as f:
            print(f.read())


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


def run_torch(args, model, mode, threads, seconds):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", mode, "--model", model, "--threads", str(threads),
           "--batch", str(args.batch), "--data", args.data, "--seconds", str(seconds), "--warmup", str(args.warmup)]
    out, bg = measure(cmd)
    return json.loads(out.strip().splitlines()[-1])["images_per_second"], bg


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
    p.add_argument("--repeats", type=int, default=3, help="rounds; the best of them is kept for each engine")
    p.add_argument("--configs", default="1core,2core")
    p.add_argument("--warmup", type=int, default=10, help="PyTorch steps before timing (twice: warm, then pace)")
    p.add_argument("--clock-ghz", type=float, help="the cores' clock for the peak (default: cpufreq, else a probe)")
    p.add_argument("--flops-per-cycle", type=int, default=32, help="FP32 FLOP per cycle per core (Zen 4: 32)")
    p.add_argument("--quiet-wait", type=float, default=0.0,
                   help="before each measurement wait up to this many seconds for the other processes to go quiet")
    p.add_argument("--quiet-below", type=float, default=0.25, help="quiet: others use fewer cores than this")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("--worker", choices=["torch", "ddp"], help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    return p.parse_args()


def runs_for(args, model, binaries, configs):
    """(label, cores, runner) per measurement; a runner takes a rate guess (dp needs a step count) and
    returns (img/s, bg)."""
    runs = []
    if "1core" in configs:
        runs.append(("PyTorch 1 thread", 1, lambda g: run_torch(args, model, "torch", 1, args.seconds)))
        for name, b in binaries.items():
            runs.append((f"{name} 1 device x 1 thread", 1, lambda g, b=b: run_dp(args, b, model, 1, args.seconds, g)))
    if "2core" in configs:
        runs.append(("PyTorch 2 threads", 2, lambda g: run_torch(args, model, "torch", 2, args.seconds)))
        runs.append(("PyTorch DDP gloo 2 x 1 thread", 2, lambda g: run_torch(args, model, "ddp", 1, args.seconds)))
        for name, b in binaries.items():
            runs.append((f"{name} 2 devices x 1 thread allreduce", 2,
                         lambda g, b=b: run_dp(args, b, model, 2, args.seconds, g)))
    return runs


def measure_rounds(args, runs):
    """--repeats rounds, the engines alternating within each; {label: [(img/s, bg) per round]}."""
    guess = {label: 5000.0 for label, _, _ in runs}
    samples = {label: [] for label, _, _ in runs}
    for rnd in range(args.repeats):
        for label, cores, runner in runs:
            if label.startswith("dp") and rnd == 0:  # a short run sets the step count for ~seconds
                guess[label], _ = runner(guess[label] * 2 / args.seconds)
            rate, bg = runner(guess[label])
            guess[label] = max(guess[label], rate)
            samples[label].append((rate, bg))
            print(f"  round {rnd + 1}  {label:<40} {rate:10,.0f} img/s   (bg {bg:.2f} cores)", flush=True)
    return samples


def print_ratios(best, binaries, configs, flops, core_peak):
    """The ratios against the targets (and dp against dp-before), printed; returns them by name."""
    ratios = {}

    def verdict(r, target):
        return "met" if r >= target else f"NOT met ({100 * r / target:.0f}% of the target)"

    def ratio(name, num, den, target):
        r = best[num] / best[den]
        ratios[name] = r
        print(f"  {name:<58} {r:5.2f}x  (target {target}x: {verdict(r, target)})")

    print()
    for name in binaries:
        if "1core" in configs:
            share = best[f"{name} 1 device x 1 thread"] * flops / 1e9 / core_peak
            print(f"  {'1 core : ' + name + ' 1 device, share of the peak':<58} {100 * share:5.1f}%  "
                  f"(target 75%: {verdict(share, 0.75)})")
            ratio(f"1 core : {name} / PyTorch", f"{name} 1 device x 1 thread", "PyTorch 1 thread", 3)
        if "2core" in configs:
            torch2 = max(("PyTorch 2 threads", "PyTorch DDP gloo 2 x 1 thread"), key=lambda k: best[k])
            ratio(f"2 cores: {name} 2 devices / {torch2}", f"{name} 2 devices x 1 thread allreduce", torch2, 3)
            if "1core" in configs:
                ratio(f"2 cores: {name} 2 devices / {name} 1 device", f"{name} 2 devices x 1 thread allreduce",
                      f"{name} 1 device x 1 thread", 1.9)
    if "dp-before" in binaries:
        for cfg in ("1 device x 1 thread", "2 devices x 1 thread allreduce"):
            if f"dp {cfg}" in best:
                ratios[f"dp / dp-before, {cfg}"] = best[f"dp {cfg}"] / best[f"dp-before {cfg}"]
                print(f"  {'after / before, ' + cfg:<58} {ratios[f'dp / dp-before, {cfg}']:5.2f}x")
    return ratios


def compare_model(args, model, binaries, configs, core_peak):
    """One model's measurements, table and ratios; returns its part of --json."""
    flops = train_flops_per_sample(model)
    print(f"\n{model}: {flops:,} training FLOPs per sample (2 per multiply-add: forward, weight gradient, "
          f"data gradient except the first layer's; = models/model.cpp train_flops_per_sample)")
    runs = runs_for(args, model, binaries, configs)
    samples = measure_rounds(args, runs)
    best = {label: max(r for r, _ in s) for label, s in samples.items()}
    result = {"flops_per_sample": flops, "best": best,
              "samples": {k: [{"images_per_second": r, "background_cores": b} for r, b in v] for k, v in samples.items()}}
    print(f"\n  {model:<8} {'configuration':<40} {'images/s':>10} {'GFLOP/s':>8} {'% peak':>7}")
    for label, cores, _ in runs:
        gflops = best[label] * flops / 1e9
        print(f"  {'':<8} {label:<40} {best[label]:10,.0f} {gflops:8.1f} {100 * gflops / (cores * core_peak):6.1f}%")
    result["ratios"] = print_ratios(best, binaries, configs, flops, core_peak)
    return result


def main():
    args = parse_args()
    if args.worker:
        return worker(args)
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
    import torch

    if os.environ.get("DP_CPU_KERNELS") == "avx2":  # both engines on AVX2 (bench/cpu_peak.py says so)
        os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
        os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
    core_peak, peak_text = peak(args)
    print(f"PyTorch {torch.__version__} (oneDNN {'on' if torch.backends.mkldnn.is_available() else 'off'}); dp: {', '.join(binaries.values())}")
    print(peak_text)
    print(f"data: {data_name}; batch {args.batch}; SGD lr 0.1 momentum 0.9; ~{args.seconds:.0f} s timed per measurement; "
          f"best of {args.repeats} rounds; engines alternate within a round")
    configs = args.configs.split(",")
    results = {}
    for model in args.models.split(","):
        results[model] = compare_model(args, model, binaries, configs, core_peak)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"peak_gflops_per_core": core_peak, "peak": peak_text, "data": data_name, "batch": args.batch,
                       "models": results}, f, indent=2)
    if tmp:
        shutil.rmtree(tmp)


if __name__ == "__main__":
    main()
