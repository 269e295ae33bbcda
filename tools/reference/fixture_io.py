"""Writing and re-reading golden fixture files (safetensors written by hand, byte-reproducible).
Used by make_fixtures.py."""

from __future__ import annotations

import contextlib
import json
import os
import platform
import struct
import sys
from collections import OrderedDict
from importlib.metadata import version as pkg_version

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import moe_reference as R  # noqa: E402

F64 = torch.float64


# =========================================================================== output
def versions():
    return dict(python=platform.python_version(), torch=torch.__version__,
                transformers=pkg_version("transformers"),
                **{"ai2-olmo-core": pkg_version("ai2-olmo-core")},
                safetensors=pkg_version("safetensors"), numpy=pkg_version("numpy"),
                script="tools/reference/make_fixtures.py")


def to_np(t):
    t = t.detach().contiguous()
    if t.dtype.is_floating_point:
        return t.to(F64).numpy()
    return t.to(torch.int32).numpy()


def write_fixture(path, tensors: "OrderedDict[str, torch.Tensor]", metadata: dict):
    """Writes safetensors by hand (byte-for-byte reproducible: the `safetensors` package orders
    __metadata__ through a hash map). Layout: u64 little-endian header length, JSON header
    (__metadata__ first, then tensors), padded with spaces to a multiple of 8 bytes, then the raw
    little-endian data: all F64 tensors (8-byte aligned), then all I32 tensors, in insertion order."""
    arrays = OrderedDict((k, np.ascontiguousarray(to_np(v))) for k, v in tensors.items())
    order = [k for k, a in arrays.items() if a.dtype == np.float64] + \
            [k for k, a in arrays.items() if a.dtype == np.int32]
    assert len(order) == len(arrays)
    header = OrderedDict()
    header["__metadata__"] = OrderedDict((k, str(v)) for k, v in metadata.items())
    off = 0
    blobs = []
    for k in order:
        a = arrays[k]
        b = a.astype(a.dtype.newbyteorder("<"), copy=False).tobytes(order="C")
        header[k] = OrderedDict(dtype="F64" if a.dtype == np.float64 else "I32",
                                shape=list(a.shape), data_offsets=[off, off + len(b)])
        off += len(b)
        blobs.append(b)
    h = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("ascii")
    h += b" " * ((-len(h)) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)
    return arrays


def read_safetensors_plain(path):
    """Independent reader with json + struct only: validates the layout and returns the arrays."""
    with open(path, "rb") as f:
        raw = f.read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n].decode("utf-8"))
    data = raw[8 + n:]
    meta = header.pop("__metadata__")
    assert all(isinstance(v, str) for v in meta.values())
    sizes = {"F64": 8, "I32": 4}
    fmt = {"F64": "d", "I32": "i"}
    spans = []
    out = {}
    for name, h in header.items():
        assert h["dtype"] in sizes, (name, h["dtype"])
        b, e = h["data_offsets"]
        count = 1
        for d in h["shape"]:
            count *= d
        assert e - b == count * sizes[h["dtype"]], name
        spans.append((b, e))
        vals = struct.unpack("<%d%s" % (count, fmt[h["dtype"]]), data[b:e])
        out[name] = (h["dtype"], tuple(h["shape"]), vals)
    spans.sort()
    pos = 0
    for b, e in spans:  # contiguous, non-overlapping, covering the whole buffer
        assert b == pos, (b, pos)
        pos = e
    assert pos == len(data)
    return meta, out


def self_test_file(path, arrays, metadata):
    meta, out = read_safetensors_plain(path)
    assert meta == metadata
    assert meta["format"] == "moecore-golden-v1"
    for k in ("config", "versions", "checks", "notes"):
        json.loads(meta[k])
    assert set(out) == set(arrays)
    for k, a in arrays.items():
        dt, shape, vals = out[k]
        assert shape == a.shape, k
        assert dt == ("F64" if a.dtype == np.float64 else "I32")
        assert np.array_equal(np.array(vals, dtype=a.dtype).reshape(shape), a), k
    # and the official package agrees
    from safetensors.numpy import load_file
    ref = load_file(path)
    assert set(ref) == set(arrays)
    for k, a in arrays.items():
        assert ref[k].dtype == a.dtype and np.array_equal(ref[k], a), k
    return len(out)
