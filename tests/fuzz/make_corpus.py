#!/usr/bin/env python3
"""Writes the fuzzers' seed corpus: a few tiny valid and invalid IDX and safetensors files.

The files are committed; rerun this only to change the seeds. Crash inputs found by scripts/fuzz.sh
are added beside them by hand (named crash-*), each with its regression test.
"""
import gzip
import json
import os
import struct

here = os.path.dirname(os.path.abspath(__file__))


def put(kind, name, data):
    with open(os.path.join(here, "corpus", kind, name), "wb") as f:
        f.write(data)


def idx_images(n, rows, cols, pixels=None):
    return struct.pack(">IIII", 0x803, n, rows, cols) + (pixels if pixels is not None else bytes(range(n * rows * cols)))


def idx_labels(labels):
    return struct.pack(">II", 0x801, len(labels)) + bytes(labels)


put("idx", "images-2x2x2", idx_images(2, 2, 2))
put("idx", "images-2x2x2.gz", gzip.compress(idx_images(2, 2, 2), mtime=0))
put("idx", "labels-3", idx_labels([3, 0, 9]))
put("idx", "labels-3.gz", gzip.compress(idx_labels([3, 0, 9]), mtime=0))
put("idx", "images-bad-magic", struct.pack(">IIII", 0x801, 1, 1, 1) + b"\x00")
put("idx", "images-truncated", idx_images(4, 2, 2, b"\x01\x02\x03"))
put("idx", "images-trailing", idx_images(1, 1, 1, b"\x01\x02"))
put("idx", "images-zero-rows", idx_images(1, 0, 2, b""))
put("idx", "images-huge-count", idx_images(0xFFFFFFFF, 4096, 4096, b""))
put("idx", "labels-out-of-range", idx_labels([1, 10, 255]))
put("idx", "labels-count-mismatch", struct.pack(">II", 0x801, 5) + b"\x01")
put("idx", "gzip-cut", gzip.compress(idx_images(2, 2, 2), mtime=0)[:-6])


def safetensors(header, data=b"", pad=True):
    h = json.dumps(header, separators=(",", ":")).encode()
    if pad:
        h += b" " * ((8 - len(h) % 8) % 8)
    return struct.pack("<Q", len(h)) + h + data


f32x2 = struct.pack("<2f", 1.5, -2.0)
put("safetensors", "one-tensor", safetensors({"__metadata__": {"global_step": "3"}, "w": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, f32x2))
put("safetensors", "empty-header", safetensors({}))
put("safetensors", "lenet-wrong-shape",
    safetensors({"__metadata__": {"model": "lenet"}, "conv1.bias": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, f32x2))
put("safetensors", "lenet5-named", safetensors({"__metadata__": {"model": "lenet5"}}))
put("safetensors", "momentum-only",
    safetensors({"optimizer.fc2.bias.momentum_buffer": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, f32x2))
put("safetensors", "wrong-dtype", safetensors({"fc2.bias": {"dtype": "I32", "shape": [2], "data_offsets": [0, 8]}}, f32x2))
put("safetensors", "overlap", safetensors({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                           "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, f32x2))
put("safetensors", "outside", safetensors({"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, f32x2))
put("safetensors", "negative-dim", safetensors({"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, f32x2))
put("safetensors", "metadata-not-string", safetensors({"__metadata__": {"global_step": 3}}))
put("safetensors", "header-past-end", struct.pack("<Q", 1 << 40) + b"{}")
put("safetensors", "not-json", struct.pack("<Q", 8) + b"{\"a\":[1,")
put("safetensors", "nested", safetensors({"a": [[[[[[[[[[[[[[[[0]]]]]]]]]]]]]]]]}))
