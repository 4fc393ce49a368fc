#!/usr/bin/env python3
"""PyTorch eager training bench/torch_compare.py's LeNet (the same layers as models/model.cpp) on the
same data, batch, optimizer and epochs as dp_train; images/s over the training steps only (evaluation
left out, as dp_train's), after 20 warm-up steps and one ragged batch (the epoch's last) whose weights and
momentum are then reset to the start. --mode eager, or torch.compile'd ("default", or "reduce-overhead":
CUDA graphs; "max-autotune-no-cudagraphs"): the compilation happens in the warm-up and is reported apart
(compile_s), left out of the rate."""
import argparse, json, time
p = argparse.ArgumentParser()
for a, d in (("--data", None), ("--device", "cuda"), ("--json", None)):
    p.add_argument(a, default=d)
p.add_argument("--mode", choices=("eager", "default", "reduce-overhead", "max-autotune-no-cudagraphs"), default="eager")
for a, d in (("--batch", 256), ("--epochs", 10), ("--max-steps", 0)):
    p.add_argument(a, type=int, default=d)
args = p.parse_args()
import numpy as np
import torch
from torch_workers import build, find_idx, load_train, read_idx

dev = torch.device(args.device)
if dev.type == "cuda" and not torch.cuda.is_available():
    raise SystemExit("torch.cuda.is_available() is False: PyTorch sees no GPU")
sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
x, y = (t.to(dev) for t in load_train(args.data))
dims, pixels = read_idx(find_idx(args.data, "t10k-images-idx3-ubyte"))
_, labels = read_idx(find_idx(args.data, "t10k-labels-idx1-ubyte"))
tx = torch.from_numpy(np.frombuffer(pixels, np.uint8).astype(np.float32) / 255.0).reshape(dims[0], 1, 28, 28).to(dev)
ty = torch.from_numpy(np.frombuffer(labels, np.uint8).astype(np.int64)).to(dev)
name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
print(f"torch {torch.__version__}, cudnn {torch.backends.cudnn.version()}, device {name}; lenet, batch {args.batch}, "
      f"SGD lr 0.1 momentum 0.9, {args.epochs} epochs of {x.shape[0]} images, {args.mode}")
loss_fn = torch.nn.CrossEntropyLoss()

torch.manual_seed(0)
net = build("lenet").to(dev)
start = {k: v.clone() for k, v in net.state_dict().items()}
model = net if args.mode == "eager" else torch.compile(net, mode=args.mode)

def step(opt, idx):
    opt.zero_grad(set_to_none=True)
    loss = loss_fn(model(x.index_select(0, idx)), y.index_select(0, idx))
    loss.backward()
    opt.step()
    return loss

# warm-up: cuDNN's and cuBLAS's handles and plans, the allocator, the compilation of both batch sizes
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
sync(); t0 = time.perf_counter()
for i in range(20):
    step(opt, torch.arange(i * args.batch, (i + 1) * args.batch, device=dev) % x.shape[0])
if x.shape[0] % args.batch:
    step(opt, torch.arange(x.shape[0] % args.batch, device=dev))
sync(); compile_s = time.perf_counter() - t0
with torch.no_grad():
    for k, v in net.state_dict().items():
        v.copy_(start[k])  # in place: a CUDA graph keeps the parameters' addresses
opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
print(f"warm-up (compilation included): {compile_s:.1f} s", flush=True)
gen = torch.Generator().manual_seed(1)
images, train_s, steps, acc = 0, 0.0, 0, 0.0
for epoch in range(args.epochs):
    perm = torch.randperm(x.shape[0], generator=gen).to(dev)
    total = torch.zeros((), device=dev)
    sync(); t0 = time.perf_counter()
    nb = 0
    for s in range(0, x.shape[0], args.batch):
        if args.max_steps and steps >= args.max_steps:
            break
        idx = perm[s : s + args.batch]
        total += step(opt, idx).detach()
        images, steps, nb = images + idx.numel(), steps + 1, nb + 1
    sync(); dt = time.perf_counter() - t0
    train_s += dt
    with torch.no_grad():
        correct = sum(int((model(tx[i : i + 1000]).argmax(1) == ty[i : i + 1000]).sum()) for i in range(0, tx.shape[0], 1000))
    acc = correct / tx.shape[0]
    print(f"epoch {epoch + 1}/{args.epochs}  train loss {float(total) / max(nb, 1):.4f}  test acc {acc:.4f}  "
          f"{nb * args.batch / dt:.0f} img/s  {dt:.1f} s", flush=True)
result = {"images_per_second": images / train_s, "test_accuracy": acc, "steps": steps, "device": name,
          "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "batch": args.batch,
          "mode": args.mode, "compile_s": compile_s}
print(json.dumps(result))
if args.json:
    json.dump(result, open(args.json, "w"), indent=2)
