"""The safetensors files of bench/make_golden.py, written and read by hand (no `safetensors`
package needed): 8-byte little-endian header length, JSON header padded with spaces to a multiple
of 8, then the packed little-endian tensor data."""

import json
import math
import os
import struct

import numpy as np
import torch

from torch_models import SAFETENSORS_DTYPES as DTYPES  # beside this script


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
        numel = math.prod(shape)
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
