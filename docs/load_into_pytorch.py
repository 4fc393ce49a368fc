#!/usr/bin/python3
"""Loads a dp checkpoint into PyTorch and measures it on the Fashion-MNIST test set.

A worked example of README's "Checkpoints load straight into PyTorch": the three models as PyTorch
modules with dp's parameter names (bench/torch_models.py, the layers of models/model.cpp; LeNet, LeNet5,
LeNetBN and MODELS are importable from here too), the checkpoint's optimizer.* tensors dropped,
load_state_dict(strict=True), then the test images scaled as dp scales them (pixels / 255). The
accuracy and mean cross-entropy it prints are dp_train's final "test acc" and test_loss for the same
weights and images (tests/test_pytorch_load.cpp checks it), up to float summation order.

    dp_train --epochs 1 --save ck.st
    /usr/bin/python3 docs/load_into_pytorch.py ck.st

The last line printed is key=value pairs: model, images, correct, test_accuracy, test_loss.

Reads the checkpoint with the `safetensors` package where it is installed, else with the few lines
of read_safetensors below (the format: an 8-byte little-endian header length, a JSON header, then
the raw little-endian tensors). Needs PyTorch and numpy (Debian: python3-torch). Exit codes: 0 done,
2 bad input (a missing file, a checkpoint that does not fit the model, a damaged IDX file).
"""

import argparse
import gzip
import json
import os
import struct
import sys

import numpy as np
import torch
import torch.nn.functional as F

# The models are defined once, in bench/torch_models.py, for bench/'s scripts too: found from this file's place.
sys.path.append(os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "bench"))
from torch_models import MODELS, SAFETENSORS_DTYPES, LeNet, LeNet5, LeNetBN  # noqa: E402,F401 (exported)

FASHION = "/usr/share/datasets/fashion-mnist"


class Fail(Exception):
    """Bad input: the message says what is wrong; exit 2, as dp_train does."""


def read_safetensors(path):
    """Returns ({name: tensor}, {metadata key: value}) from a safetensors file."""
    try:
        from safetensors import safe_open
    except ImportError:
        safe_open = None
    if safe_open is not None:
        try:
            with safe_open(path, framework="pt") as f:
                return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
        except Exception as e:  # the package's own error type differs between versions
            raise Fail(f"{path}: not a valid safetensors file: {e}")

    def bad(why):
        return Fail(f"{path}: not a valid safetensors file: {why}")

    with open(path, "rb") as f:
        raw = f.read()
    if len(raw) < 8:
        raise bad(f"only {len(raw)} bytes; the 8-byte header length is missing")
    (hlen,) = struct.unpack("<Q", raw[:8])
    if hlen > len(raw) - 8:
        raise bad(f"header length {hlen} runs past the end of the file ({len(raw)} bytes)")
    try:
        header = json.loads(raw[8 : 8 + hlen])
    except ValueError as e:
        raise bad(f"header is not JSON: {e}")
    if not isinstance(header, dict):
        raise bad("header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    data = memoryview(raw)[8 + hlen :]
    tensors = {}
    for name, info in header.items():
        try:
            dtype, shape, (begin, end) = SAFETENSORS_DTYPES[info["dtype"]][0], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise bad(f"tensor '{name}': dtype {info.get('dtype')!r} is not F32 or I64, or shape or data_offsets is malformed")
        if not 0 <= begin <= end <= len(data) or end - begin != int(np.prod(shape)) * dtype.itemsize:
            raise bad(f"tensor '{name}': data_offsets [{begin}, {end}] do not hold shape {shape} of {info['dtype']}")
        # copy(): a tensor of its own, writable, aligned, not a view into the file's bytes
        tensors[name] = torch.from_numpy(np.frombuffer(data[begin:end], dtype=dtype).reshape(shape).copy())
    return tensors, metadata


def state_dict_for(model, tensors, metadata, model_name, path):
    """The checkpoint's weights as a state_dict for model; Fail listing expected vs found if they do not fit."""
    sd = {k: v for k, v in tensors.items() if not k.startswith("optimizer.")}  # SGD momentum buffers
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    found = {k: tuple(v.shape) for k, v in sd.items()}
    if expected != found:
        saved = metadata.get("model")
        hint = f" (the checkpoint says it is {saved}: use --model {saved})" if saved and saved != model_name else ""
        listing = lambda d: "\n".join(f"    {k} {list(d[k])}" for k in sorted(d)) or "    (none)"
        raise Fail(
            f"{path}: its tensors do not match {model_name}{hint}\n"
            f"  expected ({model_name}):\n{listing(expected)}\n"
            f"  found (optimizer.* left out):\n{listing(found)}"
        )
    return sd


def idx_file(directory, name):
    """dp's choice: name.gz where it exists, else name."""
    for candidate in (os.path.join(directory, name + ".gz"), os.path.join(directory, name)):
        if os.path.isfile(candidate):
            return candidate
    raise Fail(f"{directory}: neither {name}.gz nor {name} is there (--data expects a directory of IDX files)")


def read_idx(path, magic):
    """The body of an IDX file (gzip'd or not) as uint8, shaped by its header."""
    with open(path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":
        try:
            raw = gzip.decompress(raw)
        except (OSError, EOFError) as e:
            raise Fail(f"{path}: corrupt or truncated gzip stream: {e}")
    dims = 3 if magic == 0x803 else 1
    if len(raw) < 4 + 4 * dims or struct.unpack(">I", raw[:4])[0] != magic:
        raise Fail(f"{path}: not an IDX file of magic 0x{magic:x}")
    shape = struct.unpack(f">{dims}I", raw[4 : 4 + 4 * dims])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * dims)
    if body.size != int(np.prod(shape)):
        raise Fail(f"{path}: the header declares shape {list(shape)} ({int(np.prod(shape))} bytes) but the body holds {body.size}")
    return body.reshape(shape)


def load_test_set(directory, limit):
    """(images (N, 1, 28, 28) float32 in [0, 1], labels (N,) int64): the first limit of t10k (0: all)."""
    images = read_idx(idx_file(directory, "t10k-images-idx3-ubyte"), 0x803)
    labels = read_idx(idx_file(directory, "t10k-labels-idx1-ubyte"), 0x801)
    if images.shape[1:] != (28, 28) or len(images) != len(labels):
        raise Fail(f"{directory}: t10k holds {len(images)} images of {images.shape[1:]} and {len(labels)} labels; expected 28x28 and equal counts")
    if limit > 0:
        images, labels = images[:limit], labels[:limit]
    x = torch.from_numpy(images.astype(np.float32) / np.float32(255)).unsqueeze(1)  # as train/data.cpp: p / 255.0f
    return x, torch.from_numpy(labels.astype(np.int64))


def evaluate(model, x, y, batch=1000):
    """(correct, mean cross-entropy) over the whole set; the loss summed in float64 as dp sums it."""
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            logits = model(x[i : i + batch])
            loss += F.cross_entropy(logits, y[i : i + batch], reduction="sum").item()
            correct += int((logits.argmax(1) == y[i : i + batch]).sum())
    return correct, loss / max(len(x), 1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("checkpoint", help="a safetensors file written by dp_train --save")
    ap.add_argument("--model", choices=sorted(MODELS), help="default: the model the checkpoint records, else lenet")
    ap.add_argument("--data", default=FASHION, help=f"directory of IDX files, gzip'd or not (default {FASHION})")
    ap.add_argument("--limit", type=int, default=0, metavar="N", help="only the first N test images (0: all)")
    args = ap.parse_args()
    if args.limit < 0:
        ap.error("--limit must be 0 (all) or a positive count")
    try:
        if not os.path.isfile(args.checkpoint):
            raise Fail(f"{args.checkpoint}: no such checkpoint file")
        if not os.path.isdir(args.data):
            raise Fail(f"{args.data}: no such data directory")
        tensors, metadata = read_safetensors(args.checkpoint)
        name = args.model or metadata.get("model", "lenet")
        if name not in MODELS:
            raise Fail(f"{args.checkpoint}: records model '{name}'; this script knows {', '.join(MODELS)}")
        model = MODELS[name]()
        model.load_state_dict(state_dict_for(model, tensors, metadata, name, args.checkpoint), strict=True)
        model.eval()
        x, y = load_test_set(args.data, args.limit)
    except Fail as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    correct, loss = evaluate(model, x, y)
    print(f"model={name} images={len(y)} correct={correct} test_accuracy={correct / max(len(y), 1):.4f} test_loss={loss:.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
