#!/usr/bin/python3
"""Golden reference data for dp's C++ tests.

This script writes tests/golden/<model>.safetensors for the two models dp
implements ("lenet" and "lenet5").  dp's C++ tests load these files and compare
dp's forward pass (logits, loss), backward pass (per-parameter gradients) and a
3-step SGD trajectory (momentum + weight decay) against PyTorch, starting from
exactly the same initial weights and the same fixed input batch.

Contents of each file (all float32 unless noted, PyTorch names and layouts,
i.e. conv weight is [out, in, kh, kw] and linear weight is [out, in]):

  init.<param>   PyTorch default init, torch.manual_seed(1234) right before
                 the model is constructed
  x              [N,1,28,28] input batch, torch.manual_seed(99); torch.rand
  y              [N] int64 labels  [3,1,4,1,5,9,2,6]
  logits         [N,10] model output at init
  loss           [1] mean F.cross_entropy(logits, y) at init
  grad.<param>   d loss / d param at init
  step3.<param>  weights after 3 torch.optim.SGD(lr=0.1, momentum=0.9,
                 weight_decay=5e-4) steps on the same batch, from init
  loss3          [3] loss before each of those 3 updates (loss3[0] == loss)

Header __metadata__ (all strings): model, lr, momentum, weight_decay, N, steps,
seed_init, seed_x, params (comma-separated parameter names in PyTorch order),
torch_version, generator.

Everything is computed on CPU in float32 with torch.set_num_threads(1).
The safetensors files are written by hand (no `safetensors` package needed):
8-byte little-endian header length, JSON header padded with spaces to a
multiple of 8, then the packed little-endian tensor data.

Regenerate (from the repo root; needs Debian's python3 with torch):

    /usr/bin/python3 bench/make_golden.py            # write, then verify
    /usr/bin/python3 bench/make_golden.py --check    # verify only

--check parses every file's header, checks that data offsets are contiguous,
cover the data section exactly and match dtype*shape, reloads the tensors and
compares them bit-exactly with a fresh recomputation (plus a few internal
consistency checks).  It exits non-zero on any mismatch.
"""

import argparse
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

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

DTYPES = {  # safetensors dtype -> (numpy dtype, torch dtype)
    "F32": (np.dtype("<f4"), torch.float32),
    "I64": (np.dtype("<i8"), torch.int64),
}


# dp's two models as PyTorch modules, defined once, in the worked example of loading a checkpoint.
sys.path.insert(0, os.path.join(REPO_ROOT, "docs"))
from load_into_pytorch import LeNet, LeNet5  # noqa: E402


MODELS = {
    "lenet": (LeNet, 129068),
    "lenet5": (LeNet5, 61706),
}


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
    out.append(("loss3", torch.cat(losses)))

    meta = {
        "model": name,
        "lr": repr(LR),
        "momentum": repr(MOMENTUM),
        "weight_decay": repr(WEIGHT_DECAY),
        "N": str(N),
        "steps": str(STEPS),
        "seed_init": str(SEED_INIT),
        "seed_x": str(SEED_X),
        "params": ",".join(names),
        "torch_version": torch.__version__,
        "generator": GENERATOR,
    }
    return out, meta


def st_dtype(t):
    if t.dtype == torch.float32:
        return "F32"
    if t.dtype == torch.int64:
        return "I64"
    raise TypeError(f"unsupported dtype {t.dtype}")


def write_safetensors(path, tensors, meta):
    header = {"__metadata__": meta}
    blobs = []
    offset = 0
    for n, t in tensors:
        dt = st_dtype(t)
        b = t.contiguous().numpy().astype(DTYPES[dt][0], copy=False).tobytes()
        header[n] = {"dtype": dt, "shape": list(t.shape),
                     "data_offsets": [offset, offset + len(b)]}
        blobs.append(b)
        offset += len(b)
    hjson = json.dumps(header, separators=(",", ":")).encode("utf-8")
    hjson += b" " * ((-len(hjson)) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(hjson)))
        f.write(hjson)
        for b in blobs:
            f.write(b)
    os.replace(tmp, path)


def read_safetensors(path):
    """Strict reader. Returns (ordered list of (name, tensor), metadata)."""
    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise ValueError(f"{path}: too short")
    (hlen,) = struct.unpack("<Q", raw[:8])
    if hlen % 8 != 0:
        raise ValueError(f"{path}: header length {hlen} not a multiple of 8")
    if 8 + hlen > len(raw):
        raise ValueError(f"{path}: header length {hlen} exceeds file")
    hbytes = raw[8:8 + hlen]
    if not hbytes.startswith(b"{"):
        raise ValueError(f"{path}: header does not start with '{{'")
    header = json.loads(hbytes.decode("utf-8"))
    meta = header.pop("__metadata__", {})
    for k, v in meta.items():
        if not isinstance(v, str):
            raise ValueError(f"{path}: metadata {k!r} is not a string")
    data = raw[8 + hlen:]
    entries = sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0])
    expect = 0
    tensors = []
    for n, info in entries:
        dt, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
        if dt not in DTYPES:
            raise ValueError(f"{path}: {n}: unsupported dtype {dt}")
        npdt, tdt = DTYPES[dt]
        if b != expect:
            raise ValueError(f"{path}: {n}: offset {b}, expected {expect} (not contiguous)")
        numel = 1
        for s in shape:
            numel *= s
        if e - b != numel * npdt.itemsize:
            raise ValueError(f"{path}: {n}: {e - b} bytes for shape {shape} {dt}")
        if e > len(data):
            raise ValueError(f"{path}: {n}: end {e} beyond data section {len(data)}")
        expect = e
        buf = bytearray(data[b:e])
        t = torch.frombuffer(buf, dtype=tdt).reshape(shape) if numel else \
            torch.empty(shape, dtype=tdt)
        # Cross-check with numpy decoding of the same bytes.
        a = np.frombuffer(bytes(buf), dtype=npdt).reshape(shape)
        if not np.array_equal(a, t.numpy()):
            raise ValueError(f"{path}: {n}: numpy/torch decode mismatch")
        tensors.append((n, t))
    if expect != len(data):
        raise ValueError(f"{path}: data section {len(data)} bytes, tensors cover {expect}")
    # Return in on-disk order (== header order as written by this script).
    return tensors, meta


def check(name):
    path = os.path.join(OUT_DIR, name + ".safetensors")
    got, meta = read_safetensors(path)
    want, want_meta = compute(name)
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
    for k in ("model", "lr", "momentum", "weight_decay", "N", "generator"):
        if meta.get(k) != want_meta[k]:
            errors.append(f"metadata {k}: {meta.get(k)!r} vs {want_meta[k]!r}")
    if meta.get("torch_version") != torch.__version__:
        print(f"  note: file made with torch {meta.get('torch_version')}, "
              f"checking with {torch.__version__}")
    # Internal consistency, independent of the recomputation.
    if not errors:
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
    size = os.path.getsize(path)
    if errors:
        print(f"FAIL {path} ({size} bytes)")
        for e in errors:
            print("  " + e)
        return False
    print(f"OK   {path} ({size} bytes, {len(got)} tensors) "
          f"loss={gd['loss'].item():.9g} loss3={[float(v) for v in gd['loss3']]}")
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true",
                    help="only verify existing files against a recomputation")
    ap.add_argument("--models", nargs="*", default=list(MODELS),
                    choices=list(MODELS))
    args = ap.parse_args()

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    assert torch.get_default_dtype() == torch.float32

    if not args.check:
        os.makedirs(OUT_DIR, exist_ok=True)
        for name in args.models:
            tensors, meta = compute(name)
            path = os.path.join(OUT_DIR, name + ".safetensors")
            write_safetensors(path, tensors, meta)
            print(f"wrote {path} ({os.path.getsize(path)} bytes)")
    ok = all([check(name) for name in args.models])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
