"""Where one PyTorch training step's time goes, op by op, beside dp_bench ops: the same model, batch and
optimizer as bench/torch_workers.py trains (SGD lr 0.1 momentum 0.9, cross-entropy), on --threads
threads, eager or torch.compile'd, under torch.profiler. Prints each op's self CPU time per step (ms)
and its share of the step, largest first, then the step's wall time.

  .venv-bench/bin/python bench/torch_profile.py --model lenet --mode compile --threads 1 --batch 256

An op's self time leaves out the ops it calls: a compiled graph's fused C++ kernels appear under
their inductor names (cpp_fused_...), the convolutions it hands to oneDNN as aten ops.
"""

import argparse
import time

from torch_workers import COMPILE_MODES, MODELS, build, load_train


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="lenet")
    p.add_argument("--mode", choices=("eager", *COMPILE_MODES), default="compile")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--steps", type=int, default=20, help="profiled steps")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--data", default="/usr/share/datasets/fashion-mnist")
    p.add_argument("--top", type=int, default=15, help="ops listed")
    args = p.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x, y = load_train(args.data)
    net = build(args.model)
    if args.mode in COMPILE_MODES:
        net = torch.compile(net, mode=COMPILE_MODES[args.mode])
    opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    gen = torch.Generator().manual_seed(1)

    def step():
        idx = torch.randint(0, x.shape[0], (args.batch,), generator=gen)
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)
        opt.zero_grad()
        loss_fn(net(xb), yb).backward()
        opt.step()

    for _ in range(args.warmup):
        step()
    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            step()
    wall = (time.perf_counter() - t) / args.steps * 1e3
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)
    total = sum(e.self_cpu_time_total for e in ops) / args.steps / 1e3
    print(f"PyTorch {torch.__version__}, {args.mode}, {args.model}, batch {args.batch}, {args.threads} thread(s): "
          f"{wall:.2f} ms a step under the profiler ({total:.2f} ms of ops' self time)")
    print(f"  {'op':<60} {'ms/step':>8} {'share':>6} {'calls/step':>10}")
    for e in ops[: args.top]:
        ms = e.self_cpu_time_total / args.steps / 1e3
        print(f"  {e.key[:60]:<60} {ms:8.3f} {100 * ms / total:5.1f}% {e.count / args.steps:10.1f}")


if __name__ == "__main__":
    main()
