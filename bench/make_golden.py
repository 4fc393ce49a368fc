#!/usr/bin/python3
"""Golden reference data for dp's C++ tests.

This script writes tests/golden/<model>.safetensors for the models dp
implements ("lenet", "lenet5" and "lenet-bn"), tests/golden/batchnorm.safetensors
for the BatchNorm layer alone, and adam.safetensors and clip.safetensors for the
optimizers and gradient clipping.  dp's C++ tests load these files and compare
dp's forward pass (logits, loss), backward pass (per-parameter gradients) and a
3-step SGD trajectory (momentum + weight decay) against PyTorch, starting from
exactly the same initial weights and the same fixed input batch.

What each file holds, tensor by tensor: tests/golden/README.md.

Regenerate (from the repo root; needs Debian's python3 with torch):

    /usr/bin/python3 bench/make_golden.py            # write, then verify
    /usr/bin/python3 bench/make_golden.py --check    # verify only
    /usr/bin/python3 bench/make_golden.py --models lenet-bn batchnorm   # just these
    /usr/bin/python3 bench/make_golden.py --models adam
    /usr/bin/python3 bench/make_golden.py --models clip

(lenet and lenet5 were written with torch 1.13 on another machine; recomputing
them here need not give the same bits, so rewrite them only on purpose.)

--check parses every file's header, checks that data offsets are contiguous,
cover the data section exactly and match dtype*shape, reloads the tensors and
compares them bit-exactly with a fresh recomputation (plus a few internal
consistency checks; for batchnorm, every tensor against the formulas of
kernels/ops.h evaluated in float64).  It exits non-zero on any mismatch.
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from golden_io import read_safetensors, write_safetensors  # beside this script
from torch_models import LeNet, LeNet5, LeNetBN

GENERATOR = "bench/make_golden.py"
N = 8
LABELS = [3, 1, 4, 1, 5, 9, 2, 6]
SEED_INIT = 1234
SEED_X = 99
LR = 0.1
MOMENTUM = 0.9
WEIGHT_DECAY = 5e-4
STEPS = 3

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT_DIR = os.path.join(REPO_ROOT, "tests", "golden")

MODELS = {
    "lenet": (LeNet, 129068),
    "lenet5": (LeNet5, 61706),
    "lenet-bn": (LeNetBN, 129464),
}
# Files of one layer each: name -> (compute, internal consistency check).
LAYERS = {}  # filled in below the layer functions


def make_model(name):
    cls, expected = MODELS[name]
    torch.manual_seed(SEED_INIT)
    model = cls()
    count = sum(p.numel() for p in model.parameters())
    assert count == expected, f"{name}: {count} parameters, expected {expected}"
    return model


def make_batch():
    torch.manual_seed(SEED_X)
    x = torch.rand(N, 1, 28, 28)
    y = torch.tensor(LABELS, dtype=torch.int64)
    assert x.dtype == torch.float32 and x.min() >= 0 and x.max() <= 1
    return x, y


def compute(name):
    """Returns (ordered list of (tensor name, tensor), metadata dict)."""
    model = make_model(name)
    names = [n for n, _ in model.named_parameters()]
    x, y = make_batch()
    out = []
    for n, p in model.named_parameters():
        out.append(("init." + n, p.detach().clone()))
    out.append(("x", x.clone()))
    out.append(("y", y.clone()))

    # Forward + backward at init.
    model.zero_grad()
    logits = model(x)
    loss = F.cross_entropy(logits, y)
    loss.backward()
    out.append(("logits", logits.detach().clone()))
    out.append(("loss", loss.detach().reshape(1).clone()))
    for n, p in model.named_parameters():
        out.append(("grad." + n, p.grad.detach().clone()))

    # 3 SGD steps from init on the same batch (fresh model, same seed).
    model = make_model(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM,
                          weight_decay=WEIGHT_DECAY)
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss_s = F.cross_entropy(model(x), y)
        loss_s.backward()
        losses.append(loss_s.detach().reshape(1).clone())
        opt.step()
    for n, p in model.named_parameters():
        out.append(("step3." + n, p.detach().clone()))
    buffers = [n for n, _ in model.named_buffers()]  # none in lenet and lenet5
    for n, b in model.named_buffers():
        out.append(("step3." + n, b.detach().clone()))
    out.append(("loss3", torch.cat(losses)))

    meta = {"model": name, "lr": repr(LR), "momentum": repr(MOMENTUM),
            "weight_decay": repr(WEIGHT_DECAY), "N": str(N), "steps": str(STEPS),
            "seed_init": str(SEED_INIT), "seed_x": str(SEED_X), "params": ",".join(names),
            "torch_version": torch.__version__, "generator": GENERATOR}
    if buffers:  # lenet-bn only: lenet and lenet5 keep their metadata byte for byte
        bns = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert all(m.eps == bns[0].eps and m.momentum == bns[0].momentum for m in bns)
        meta["bn_eps"] = repr(bns[0].eps)
        meta["bn_momentum"] = repr(bns[0].momentum)
        meta["buffers"] = ",".join(buffers)
    return out, meta


# --- the BatchNorm layer alone --------------------------------------------------------------------

BN_EPS = 1e-3
BN_MOMENTUM = 0.2
SEED_BN = 7
BN_CASES = [("bn2d", nn.BatchNorm2d, (4, 5, 3, 3)), ("bn1d", nn.BatchNorm1d, (6, 7))]


def compute_batchnorm():
    """One training-mode forward and backward of BatchNorm2d and BatchNorm1d, then evaluation."""
    torch.manual_seed(SEED_BN)
    out = []
    for prefix, cls, shape in BN_CASES:
        c = shape[1]
        per_channel = [1, c] + [1] * (len(shape) - 2)  # broadcasts a (C) vector over x
        spread = (0.5 + torch.rand(c)).reshape(per_channel)
        offset = (2 * torch.randn(c)).reshape(per_channel)
        x = torch.randn(shape) * spread + offset
        weight = 1 + 0.5 * torch.randn(c)
        bias = 0.5 * torch.randn(c)
        running_mean0 = 0.3 * torch.randn(c)
        running_var0 = 0.5 + torch.rand(c)
        dy = torch.randn(shape)

        layer = cls(c, eps=BN_EPS, momentum=BN_MOMENTUM)
        with torch.no_grad():
            layer.weight.copy_(weight)
            layer.bias.copy_(bias)
            layer.running_mean.copy_(running_mean0)
            layer.running_var.copy_(running_var0)
        layer.train()
        xg = x.clone().requires_grad_(True)
        y = layer(xg)
        y.backward(dy)
        layer.eval()
        with torch.no_grad():
            y_eval = layer(x)
        for n, t in [("x", x), ("weight", weight), ("bias", bias), ("running_mean0", running_mean0),
                     ("running_var0", running_var0), ("dy", dy), ("y", y), ("dx", xg.grad),
                     ("dweight", layer.weight.grad), ("dbias", layer.bias.grad),
                     ("running_mean", layer.running_mean), ("running_var", layer.running_var),
                     ("y_eval", y_eval)]:
            out.append((prefix + "." + n, t.detach().clone()))
    meta = {"layer": "batchnorm", "eps": repr(BN_EPS), "momentum": repr(BN_MOMENTUM),
            "seed": str(SEED_BN), "cases": ",".join(p for p, _, _ in BN_CASES),
            "torch_version": torch.__version__, "generator": GENERATOR}
    return out, meta


def batchnorm_consistency(gd):
    """Every output against kernels/ops.h's formulas in float64: the semantics dp implements."""
    errors = []
    for prefix, _, shape in BN_CASES:
        t = {k[len(prefix) + 1:]: v.double() for k, v in gd.items() if k.startswith(prefix + ".")}
        dims = [0] + list(range(2, len(shape)))
        per_channel = [1, shape[1]] + [1] * (len(shape) - 2)
        count = t["x"].numel() // shape[1]

        def ch(v):
            return v.reshape(per_channel)

        mean = t["x"].mean(dims)
        var = ((t["x"] - ch(mean)) ** 2).mean(dims)  # biased
        inv_std = 1 / torch.sqrt(var + BN_EPS)
        xhat = (t["x"] - ch(mean)) * ch(inv_std)
        sum_dy = t["dy"].sum(dims)
        sum_dy_xhat = (t["dy"] * xhat).sum(dims)
        want = {
            "y": xhat * ch(t["weight"]) + ch(t["bias"]),
            "dbias": sum_dy,
            "dweight": sum_dy_xhat,
            "dx": ch(t["weight"] * inv_std)
            * (t["dy"] - ch(sum_dy / count) - xhat * ch(sum_dy_xhat / count)),
            "running_mean": (1 - BN_MOMENTUM) * t["running_mean0"] + BN_MOMENTUM * mean,
            "running_var": (1 - BN_MOMENTUM) * t["running_var0"]
            + BN_MOMENTUM * var * count / (count - 1),  # unbiased
            "y_eval": (t["x"] - ch(t["running_mean"])) / ch(torch.sqrt(t["running_var"] + BN_EPS))
            * ch(t["weight"]) + ch(t["bias"]),
        }
        for n, w in want.items():
            d = (t[n] - w).abs().max().item()
            if d > 1e-4 * max(1.0, w.abs().max().item()):
                errors.append(f"{prefix}.{n}: differs from the float64 formula by {d:.3g}")
    return errors


LAYERS["batchnorm"] = (compute_batchnorm, batchnorm_consistency)


# --- Adam and AdamW on lenet, in float64 ----------------------------------------------------------

ADAM_LR = 1e-3
ADAMW_DECAY = 0.5  # far past AdamW's default 0.01, so that decoupled and L2 decay differ visibly
ADAM_CASES = [("adam3", torch.optim.Adam, {}), ("adamw3", torch.optim.AdamW, {"weight_decay": ADAMW_DECAY})]


def lenet_start():
    """lenet at its float32 init, its parameter names, the batch, and the tensors an optimizer file
    starts with (init.*, x, y)."""
    model = make_model("lenet")
    x, y = make_batch()
    out = [("init." + n, p.detach().clone()) for n, p in model.named_parameters()]
    out += [("x", x.clone()), ("y", y.clone())]
    return model, [n for n, _ in model.named_parameters()], x, y, out


def compute_adam():
    """lenet from its float32 init: 3 Adam and 3 AdamW steps on the batch, computed in float64."""
    _, names, x, y, out = lenet_start()
    model = make_model("lenet").double()
    F.cross_entropy(model(x.double()), y).backward()
    out += [("grad64." + n, p.grad.detach().float().clone()) for n, p in model.named_parameters()]
    for prefix, cls, kw in ADAM_CASES:
        model = make_model("lenet").double()
        opt = cls(model.parameters(), lr=ADAM_LR, **kw)
        losses = []
        for _ in range(STEPS):
            opt.zero_grad()
            loss = F.cross_entropy(model(x.double()), y)
            loss.backward()
            losses.append(loss.detach().reshape(1))
            opt.step()
        out += [(prefix + "." + n, p.detach().float().clone()) for n, p in model.named_parameters()]
        out.append((prefix + ".loss", torch.cat(losses).float()))
    meta = {"layer": "adam", "model": "lenet", "lr": repr(ADAM_LR), "adamw_weight_decay": repr(ADAMW_DECAY),
            "betas": "0.9,0.999", "eps": "1e-08", "N": str(N), "steps": str(STEPS),
            "params": ",".join(names), "torch_version": torch.__version__, "generator": GENERATOR}
    return out, meta


def adam_consistency(gd):
    """No weight moved past what 3 steps of lr each allow (Adam's step is about lr at most)."""
    errors = []
    for prefix, _, _ in ADAM_CASES:
        for n, t in gd.items():
            if n.startswith(prefix + ".") and n != prefix + ".loss":
                moved = (t.double() - gd["init." + n[len(prefix) + 1:]].double()).abs().max().item()
                if moved > 3 * STEPS * ADAM_LR:
                    errors.append(f"{n}: moved {moved:.3g} in {STEPS} steps of lr {ADAM_LR}")
    return errors


LAYERS["adam"] = (compute_adam, adam_consistency)


CLIP_MAX_NORM = 0.2


def compute_clip():
    """lenet from its float32 init: 3 SGD steps with clip_grad_norm_ before each, in float32."""
    model, names, x, y, out = lenet_start()
    opt = torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM, weight_decay=WEIGHT_DECAY)
    losses, norms = [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP_MAX_NORM).detach().reshape(1).float())
        losses.append(loss.detach().reshape(1))
        opt.step()
    out += [("clip3." + n, p.detach().clone()) for n, p in model.named_parameters()]
    out += [("clip3.loss", torch.cat(losses)), ("clip3.norm", torch.cat(norms))]
    meta = {"layer": "clip", "model": "lenet", "lr": repr(LR), "momentum": repr(MOMENTUM),
            "weight_decay": repr(WEIGHT_DECAY), "max_norm": repr(CLIP_MAX_NORM), "N": str(N),
            "steps": str(STEPS), "params": ",".join(names), "torch_version": torch.__version__,
            "generator": GENERATOR}
    return out, meta


def clip_consistency(gd):
    """Every step was clipped: its norm above max_norm."""
    norms = gd["clip3.norm"].tolist()
    return [f"step {i + 1}: norm {v:.4g} is within {CLIP_MAX_NORM}: not clipped" for i, v in enumerate(norms)
            if v <= CLIP_MAX_NORM]


LAYERS["clip"] = (compute_clip, clip_consistency)


def compute_any(name):
    return LAYERS[name][0]() if name in LAYERS else compute(name)


def check(name):
    path = os.path.join(OUT_DIR, name + ".safetensors")
    got, meta = read_safetensors(path)
    want, want_meta = compute_any(name)
    errors = []
    gnames = [n for n, _ in got]
    wnames = [n for n, _ in want]
    if gnames != wnames:
        errors.append(f"tensor names/order differ:\n  file: {gnames}\n  want: {wnames}")
    gd = dict(got)
    for n, w in want:
        g = gd.get(n)
        if g is None:
            continue
        if g.dtype != w.dtype or list(g.shape) != list(w.shape):
            errors.append(f"{n}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
        elif not torch.equal(g, w):
            errors.append(f"{n}: values differ (max abs diff "
                          f"{(g.double() - w.double()).abs().max().item():.3g})")
    keys = ("model", "lr", "momentum", "weight_decay", "N", "generator") if name in MODELS else \
        tuple(k for k in want_meta if k != "torch_version")
    for k in keys:
        if meta.get(k) != want_meta[k]:
            errors.append(f"metadata {k}: {meta.get(k)!r} vs {want_meta[k]!r}")
    if meta.get("torch_version") != torch.__version__:
        print(f"  note: file made with torch {meta.get('torch_version')}, "
              f"checking with {torch.__version__}")
    # Internal consistency, independent of the recomputation.
    if not errors and name in LAYERS:
        errors += LAYERS[name][1](gd)
    elif not errors:
        if not torch.equal(gd["loss"], gd["loss3"][:1]):
            errors.append("loss != loss3[0]")
        ref = F.cross_entropy(gd["logits"].double(), gd["y"]).item()
        if abs(ref - gd["loss"].item()) > 1e-5:
            errors.append(f"loss {gd['loss'].item()} vs float64 CE of logits {ref}")
        if sorted(gd["y"].tolist()) != sorted(LABELS) or gd["y"].tolist() != LABELS:
            errors.append("labels differ")
        if not (gd["x"].min() >= 0 and gd["x"].max() <= 1):
            errors.append("x outside [0,1]")
        nparams = sum(t.numel() for n, t in got if n.startswith("init."))
        if nparams != MODELS[name][1]:
            errors.append(f"{nparams} init parameters, expected {MODELS[name][1]}")
        for n, t in got:
            if n.endswith(".num_batches_tracked") and t.item() != STEPS:
                errors.append(f"{n} = {t.item()}, expected {STEPS}")
    size = os.path.getsize(path)
    if errors:
        print(f"FAIL {path} ({size} bytes)")
        for e in errors:
            print("  " + e)
        return False
    if name in LAYERS:
        print(f"OK   {path} ({size} bytes, {len(got)} tensors)")
        return True
    print(f"OK   {path} ({size} bytes, {len(got)} tensors) "
          f"loss={gd['loss'].item():.9g} loss3={[float(v) for v in gd['loss3']]}")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only verify existing files against a recomputation")
    ap.add_argument("--models", nargs="*", default=list(MODELS) + list(LAYERS),
                    choices=list(MODELS) + list(LAYERS))
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    assert torch.get_default_dtype() == torch.float32

    if not args.check:
        os.makedirs(OUT_DIR, exist_ok=True)
        for name in args.models:
            tensors, meta = compute_any(name)
            path = os.path.join(OUT_DIR, name + ".safetensors")
            write_safetensors(path, tensors, meta)
            print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    ok = all([check(name) for name in args.models])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
