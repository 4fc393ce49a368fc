"""PyTorch's side of bench/torch_compare.py: the data as dp reads it, the models, and one measurement
per process. torch_compare.py runs this file with each PyTorch it compares (Debian's 1.13 with
/usr/bin/python3, 2.x from the virtual environment scripts/deps.sh --bench makes), so that both are
measured by the same code:

  python bench/torch_workers.py --mode eager|compile|compile-max|ddp|torchrun --model lenet --threads 1 \
      --batch 256 --data DIR --seconds 12 --warmup 10

prints one JSON line: images_per_second over the timed steps, and compile_s, the first step's time
(torch.compile's compilation, left out of the rate; an eager first step for comparison).
  eager        the module as written, torch.set_num_threads(--threads)
  compile      torch.compile(module) (inductor, mode "default"): PyTorch 2 only
  compile-max  torch.compile(module, mode="max-autotune-no-cudagraphs")
  ddp          DistributedDataParallel over gloo, 2 processes of 1 thread on 127.0.0.1 (the rate of both),
               started by torch.multiprocessing.spawn
  torchrun     the same DDP, its 2 processes started by torchrun (torch.distributed.run --standalone
               --nproc_per_node 2), as a user launches it; each runs --mode ddp-rank with torchrun's RANK,
               WORLD_SIZE, MASTER_ADDR and MASTER_PORT, and rank 0 writes the result to --out
"""

import argparse
import gzip
import json
import os
import struct
import tempfile
import time

MODELS = ("lenet", "lenet5")
COMPILE_MODES = {"compile": "default", "compile-max": "max-autotune-no-cudagraphs"}


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


def load_train(directory):
    """The training set as dp reads it (train/data.cpp): pixels / 255 as float, labels as classes."""
    import numpy as np
    import torch

    dims, pixels = read_idx(find_idx(directory, "train-images-idx3-ubyte"))
    _, labels = read_idx(find_idx(directory, "train-labels-idx1-ubyte"))
    x = torch.from_numpy(np.frombuffer(pixels, dtype=np.uint8).astype(np.float32) / 255.0)
    y = torch.from_numpy(np.frombuffer(labels, dtype=np.uint8).astype(np.int64))
    return x.reshape(dims[0], 1, dims[1], dims[2]), y


def build(name):
    """models/model.cpp's layers as a torch.nn module (bench/torch_models.py), for the models compared here."""
    import torch_models  # beside this script; imported here, as torch is, so that --help needs neither

    if name not in MODELS:
        raise SystemExit(f"unknown model {name}")
    return torch_models.MODELS[name]()


def torch_loop(name, batch, x, y, seconds, warmup, rank=0, world=1, wrap=None, agree_steps=None):
    """Trains with a DistributedSampler-like slice per rank; returns (steps, seconds) of the timed part
    and the first step's seconds (a compiled module compiles there)."""
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

    t = time.perf_counter()
    step()
    first = time.perf_counter() - t
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
    return steps, time.perf_counter() - t, first


def ddp_rank(rank, world, port, args, out):
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    if port is not None:  # spawned here; under torchrun its environment says where rank 0 listens
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    x, y = load_train(args.data)

    def agree(steps):
        t = torch.tensor([steps])
        dist.broadcast(t, 0)
        return int(t.item())

    dist.barrier()
    steps, seconds, first = torch_loop(args.model, args.batch, x, y, args.seconds, args.warmup, rank, world,
                                       wrap=DistributedDataParallel, agree_steps=agree)
    dist.barrier()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(result(args, steps, seconds, first), f)
    dist.destroy_process_group()


def result(args, steps, seconds, first):
    import torch

    return {"images_per_second": steps * args.batch / seconds, "steps": steps, "seconds": seconds,
            "compile_s": first, "torch": torch.__version__, "mode": args.mode}


def run_torchrun(args):
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rank0.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
               os.path.abspath(__file__), "--mode", "ddp-rank", "--out", out, "--model", args.model,
               "--batch", str(args.batch), "--data", args.data, "--seconds", str(args.seconds),
               "--warmup", str(args.warmup)]
        # torchrun sets OMP_NUM_THREADS=1 per process itself; ddp_rank sets one thread as well
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            print(f.read())


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("eager", "ddp", "torchrun", "ddp-rank", *COMPILE_MODES), default="eager")
    p.add_argument("--out", help="ddp-rank: where rank 0 writes its JSON result")
    p.add_argument("--model", choices=MODELS, default="lenet")
    p.add_argument("--data", required=True)
    for a, d in (("--threads", 1), ("--batch", 256), ("--warmup", 10)):
        p.add_argument(a, type=int, default=d)
    p.add_argument("--seconds", type=float, default=12.0)
    args = p.parse_args()
    import torch

    if args.mode == "ddp-rank":  # one process of torchrun's
        ddp_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), None, args, args.out)
        return
    if args.mode == "torchrun":
        run_torchrun(args)
        return
    if args.mode != "ddp":
        torch.set_num_threads(args.threads)
        wrap = None
        if args.mode in COMPILE_MODES:
            if not hasattr(torch, "compile"):
                raise SystemExit(f"--mode {args.mode}: PyTorch {torch.__version__} has no torch.compile (2.0 or later)")
            wrap = lambda net: torch.compile(net, mode=COMPILE_MODES[args.mode])  # noqa: E731
        x, y = load_train(args.data)
        print(json.dumps(result(args, *torch_loop(args.model, args.batch, x, y, args.seconds, args.warmup,
                                                    wrap=wrap))))
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


if __name__ == "__main__":
    main()
