"""Writes tests/golden/mxfp8/quantize.safetensors: MXFP8 quantization by torchao (pinned 0.18.0), the code the
C++ quantizer (src/core/mxfp8.h, the mx_quantize op) must match bit for bit. CI only reads the file.

    /tmp/refenv/bin/pip install torch==2.10.0 torchao==0.18.0 ml_dtypes==0.7.0 numpy==2.4.6
    /tmp/refenv/bin/python tools/reference/make_mx_fixtures.py [--out tests/golden/mxfp8/quantize.safetensors]

Every case quantizes one input under both scale rules ("rceil", "floor": passed explicitly, to_mx
defaults to floor) and both elements (E4M3, E5M2), blocks of 32 along the last dimension ("row") or,
for the column-wise copy, along the first (torchao quantizes x.t().contiguous()). For each it stores
  <case>.x                  the input (F32 or BF16 bytes), shape (R, C)
  <case>.<elem>.<rule>.torchao_codes / torchao_scales   torchao's bytes, untouched
  <case>.<elem>.<rule>.codes / scales                   the expected bytes
  <case>.<elem>.<rule>.deviations                       I32 (n, 2): (block, reason) where they differ
  <case>.<elem>.<rule>.dequantized                      F32: torchao's to_dtype of the expected bytes
                                                        (not for the boundary and midpoint cases)
Expected = torchao's, except in blocks where torchao's eager code departs from the rule it documents;
there the script proves the reason and recomputes the block with torchao's own arithmetic and the
documented scale (torch's saturating-by-clamp cast):
  reason 1 (rceil): torchao takes ceil(torch.log2(amax / max)) in fp32; for a descale a few ulps above
    2^k the fp32 log2 rounds to exactly k, so torchao keeps 2^k and the amax saturates. The rule
    (cuBLAS "1D block quantization", cvt.rp.satfinite.ue8m0 on Blackwell) rounds up to 2^(k+1).
  reason 2 (floor): a scale clamped at 2^-127 divides the values by 2^-126 in torchao (its comment: a
    Triton workaround; "more correct to set the minimum to 2**-127"); the OCP rule divides by 2^-127.
ml_dtypes decodes bytes only (decode.e4m3, decode.e5m2: every code's value): its own casts do not
saturate. Output is byte-reproducible (sorted header, fixed seeds).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import struct
from collections import OrderedDict
from importlib.metadata import version as pkg_version

import ml_dtypes
import numpy as np
import torch
from torchao.prototype.mx_formats.config import ScaleCalculationMode
from torchao.prototype.mx_formats.mx_tensor import to_dtype, to_mx

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ELEMS = OrderedDict(e4m3=(torch.float8_e4m3fn, 448.0, 8), e5m2=(torch.float8_e5m2, 57344.0, 15))
RULES = OrderedDict(rceil=ScaleCalculationMode.RCEIL, floor=ScaleCalculationMode.FLOOR)
B = 32


def f32(x):
    return np.float32(x)


def f32_from_bits(b):
    return np.array([b], np.uint32).view(np.float32)[0]


def bits(x):
    return int(np.array([x], np.float32).view(np.uint32)[0])


def finite_codes(elem):
    vals = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn if elem == "e4m3"
                                                else ml_dtypes.float8_e5m2).astype(np.float32)
    return [c for c in range(256) if np.isfinite(vals[c])], vals


# ------------------------------------------------------------------------------- inputs
def case_codes(elem):
    """Every finite code in every block position: anchor position p holds the element's max; the
    other 31 lanes hold the codes, code index i at lane (p + 1 + i % 31) % 32, so over the 32 anchor
    positions each code visits every lane. Each block is scaled by its own 2^k."""
    codes, vals = finite_codes(elem)
    nb = math.ceil(len(codes) / 31)
    x = np.zeros((32 * nb, B), np.float32)
    for p in range(32):
        for j in range(nb):
            r = p * nb + j
            x[r, p] = ELEMS[elem][1]
            for i in range(31 * j, min(31 * j + 31, len(codes))):
                x[r, (p + 1 + i % 31) % 32] = vals[codes[i]]
            x[r] *= f32(2.0 ** ((r % 41) - 20))
    return x


def case_midpoints(elem):
    """Midpoints between neighbouring positive codes (and between 0 and the smallest subnormal),
    one fp32 ulp either side, both signs; lane 0 holds the anchor max so the scale is 1."""
    codes, vals = finite_codes(elem)
    pos = sorted({float(vals[c]) for c in codes if vals[c] >= 0})
    lanes = []
    for a, b in zip(pos, pos[1:]):
        m = f32((a + b) / 2)
        assert float(m) == (a + b) / 2
        for v in (f32_from_bits(bits(m) - 1), m, f32_from_bits(bits(m) + 1)):
            lanes += [v, -v]
    lanes += [f32(ELEMS[elem][1] * 1.0625), f32(-ELEMS[elem][1] * 1.5)]  # past max: saturate
    rows = math.ceil(len(lanes) / 31)
    x = np.zeros((rows, B), np.float32)
    for i, v in enumerate(lanes):
        x[i // 31, 1 + i % 31] = v
    x[:, 0] = ELEMS[elem][1]
    return x


def case_boundary(elem, rng):
    """amax exactly max * 2^k, and 1 or 2 fp32 ulps either side, for every k whose amax is a
    normal fp32: the rceil boundary (the descale amax / max, rounded in fp32, crosses 2^k)."""
    emax = ELEMS[elem][1]
    rows = []
    for k in range(-149, 128):
        base = emax * 2.0 ** k
        if not float(np.finfo(np.float32).tiny) <= base <= float(np.finfo(np.float32).max):
            continue
        for d in (-2, -1, 0, 1, 2):
            amax = f32_from_bits(bits(f32(base)) + d)
            row = (rng.uniform(-1, 1, B).astype(np.float32) * amax).astype(np.float32)
            row[(k + d) % B] = amax if d % 2 == 0 else -amax
            rows.append(row)
    return np.stack(rows)


def case_clamp(rng):
    """Blocks whose scale clamps: amax from the smallest subnormal up past 2^-118, and huge ones."""
    amaxes = [2.0 ** -149, 2.0 ** -145, 2.0 ** -140, 2.0 ** -136, 2.0 ** -135, 2.0 ** -133,
              2.0 ** -130, 2.0 ** -128, 2.0 ** -127, 2.0 ** -126, 2.0 ** -125, 2.0 ** -123,
              2.0 ** -120, 2.0 ** -119, 2.0 ** -118, 2.0 ** -117, 2.0 ** -110, 1e-38, 3e-39,
              2.0 ** 100, 2.0 ** 119, 2.0 ** 120, 2.0 ** 127, 1e38,
              float(np.finfo(np.float32).max)]
    rows = []
    for a in amaxes:
        for frac in ("uniform", "pow2"):
            a32 = f32(a)
            if frac == "uniform":
                row = (rng.uniform(-1, 1, B).astype(np.float32) * a32).astype(np.float32)
            else:
                row = np.array([a32 * f32(2.0 ** -(i % 12)) for i in range(B)], np.float32)
            row[5] = a32
            rows.append(row)
    return np.stack(rows)


def case_subnormal(rng):
    """fp32 subnormal inputs: all-subnormal blocks and subnormals beside normal values."""
    tiny = np.finfo(np.float32).tiny
    rows = []
    sub = (rng.uniform(-1, 1, (4, B)) * tiny).astype(np.float32)
    rows += list(sub)
    mixed = (rng.uniform(-1, 1, (4, B)) * tiny).astype(np.float32)
    mixed[:, 7] = [1.0, 2.0 ** -100, 2.0 ** -120, 2.0 ** -126]
    rows += list(mixed)
    denorm_bits = np.array([1, 2, 3, 0x7fffff, 0x400000, 0x1000, 0x80000001, 0x807fffff],
                           np.uint32).view(np.float32)
    row = np.zeros(B, np.float32)
    row[:8] = denorm_bits
    rows.append(row)
    return np.stack(rows)


def case_special():
    """NaN, -NaN, +Inf, -Inf, -0 in one lane of a normal block; all-zero and all -0 blocks."""
    base = np.linspace(-3, 5, B).astype(np.float32)
    neg_nan = np.array([0xffc00000], np.uint32).view(np.float32)[0]
    rows = []
    for lane, v in ((3, np.nan), (3, neg_nan), (0, np.inf), (31, -np.inf), (9, -0.0)):
        r = base.copy()
        r[lane] = v
        rows.append(r)
    rows.append(np.zeros(B, np.float32))
    rows.append(np.full(B, -0.0, np.float32))
    r = np.full(B, np.inf, np.float32)
    r[1] = -np.inf
    rows.append(r)
    return np.stack(rows)


def case_random(rng, shape):
    x = rng.standard_normal(shape) * np.exp(rng.standard_normal((shape[0], 1)) * 3)
    return x.astype(np.float32)


# ------------------------------------------------------------------------------- quantization
def quantize(x_hp, elem, rule):
    """torchao's bytes and the expected bytes for x_hp (torch, float32 or bfloat16, blocks along
    the last dim), with the deviating blocks and their reasons."""
    dt, emax, emax_pow2 = ELEMS[elem]
    s_t, d_t = to_mx(x_hp, dt, B, RULES[rule])
    s_t = s_t.view(torch.uint8).reshape(-1).clone()
    c_t = d_t.view(torch.uint8).reshape(-1, B).clone()
    blocks = x_hp.to(torch.float32).reshape(-1, B)
    s_e, c_e = s_t.clone(), c_t.clone()
    devs = []
    for b in range(blocks.shape[0]):
        xb = blocks[b]
        amax = torch.amax(torch.abs(xb))
        if torch.isnan(amax):
            continue
        if rule == "rceil":
            descale = (amax / emax).item()  # fp32 division, as torchao's
            if math.isinf(descale) or descale == 0:
                continue
            m, ex = math.frexp(descale)
            e = (ex - 1 if m == 0.5 else ex)
            e = max(-127, min(127, e)) + 127
            if e == s_t[b].item():
                continue
            lg = torch.log2(torch.tensor(descale, dtype=torch.float32)).item()
            assert m != 0.5 and lg == math.floor(lg), (elem, rule, b, descale, lg)
            assert e == s_t[b].item() + 1
            rcp = 1.0 if e == 0 else 2.0 ** (127 - e)
            lp = torch.clamp(xb * torch.tensor(rcp, dtype=torch.float32), -emax, emax)
            reason = 1
        else:
            if s_t[b].item() != 0:
                continue
            lp = torch.clamp(xb / torch.tensor(2.0 ** -127, dtype=torch.float32), -emax, emax)
            e = 0
            reason = 2
        codes = lp.to(dt).view(torch.uint8)
        if e == s_t[b].item() and torch.equal(codes, c_t[b]):
            continue
        s_e[b] = e
        c_e[b] = codes
        devs.append((b, reason))
    shape = tuple(x_hp.shape)
    deq = to_dtype(c_e.reshape(shape).view(dt), s_e.reshape(*shape[:-1], shape[-1] // B)
                   .view(torch.float8_e8m0fnu), dt, B, torch.float32)
    return (c_t.reshape(shape), s_t.reshape(*shape[:-1], -1), c_e.reshape(shape),
            s_e.reshape(*shape[:-1], -1), np.array(devs, np.int32).reshape(-1, 2), deq)


# ------------------------------------------------------------------------------- output
def np_bytes(a):
    return np.ascontiguousarray(a).tobytes()


def write(path, tensors, metadata):
    header = OrderedDict()
    header["__metadata__"] = OrderedDict(sorted(metadata.items()))
    off = 0
    blobs = []
    for name in sorted(tensors):
        dtype, shape, raw = tensors[name]
        header[name] = OrderedDict(dtype=dtype, shape=list(shape), data_offsets=[off, off + len(raw)])
        blobs.append(raw)
        off += len(raw)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/golden/mxfp8/quantize.safetensors"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    rng = np.random.default_rng(20261202)

    # name -> (np input f32, input dtype "F32"/"BF16", axis, elements): the element-specific
    # cases (codes, midpoints, the max * 2^k boundary) for their element only.
    cases = OrderedDict()
    both = tuple(ELEMS)
    for elem in ELEMS:
        cases[f"codes_{elem}"] = (case_codes(elem), "F32", "row", (elem,))
        cases[f"midpoints_{elem}"] = (case_midpoints(elem), "F32", "row", (elem,))
        cases[f"boundary_{elem}"] = (case_boundary(elem, rng), "F32", "row", (elem,))
    cases["clamp"] = (case_clamp(rng), "F32", "row", both)
    cases["subnormal_f32"] = (case_subnormal(rng), "F32", "row", both)
    bf_sub = (rng.uniform(-1, 1, (6, B)) * 2.0 ** -128).astype(np.float32)
    bf_sub[3:, 11] = [1.0, 2.0 ** -120, 2.0 ** -127]
    cases["subnormal_bf16"] = (bf_sub, "BF16", "row", both)
    cases["special"] = (case_special(), "F32", "row", both)
    cases["random_row_f32"] = (case_random(rng, (64, 96)), "F32", "row", both)
    cases["random_col_f32"] = (case_random(rng, (64, 96)), "F32", "col", both)
    cases["random_row_bf16"] = (case_random(rng, (48, 128)), "BF16", "row", both)
    cases["random_col_bf16"] = (case_random(rng, (96, 64)), "BF16", "col", both)

    tensors = OrderedDict()
    summary = {}
    for name, (x, in_dtype, axis, elems) in cases.items():
        xt = torch.from_numpy(x.copy())
        if in_dtype == "BF16":
            xt = xt.to(torch.bfloat16)
            raw = np_bytes(xt.view(torch.int16).numpy())
        else:
            raw = np_bytes(x)
        tensors[f"{name}.x"] = (in_dtype, x.shape, raw)
        q_in = xt.t().contiguous() if axis == "col" else xt
        for elem in elems:
            for rule in RULES:
                ct, st, ce, se, devs, deq = quantize(q_in, elem, rule)
                p = f"{name}.{elem}.{rule}."
                tensors[p + "torchao_codes"] = ("U8", ct.shape, np_bytes(ct.numpy()))
                tensors[p + "torchao_scales"] = ("U8", st.shape, np_bytes(st.numpy()))
                tensors[p + "codes"] = ("U8", ce.shape, np_bytes(ce.numpy()))
                tensors[p + "scales"] = ("U8", se.shape, np_bytes(se.numpy()))
                tensors[p + "deviations"] = ("I32", devs.shape, np_bytes(devs))
                if not name.startswith(("boundary", "midpoints")):  # size: values checked elsewhere
                    tensors[p + "dequantized"] = ("F32", deq.shape, np_bytes(deq.numpy()))
                summary[p[:-1]] = len(devs)
        summary[f"{name}.axis"] = axis
    for elem in ELEMS:
        _, vals = finite_codes(elem)
        tensors[f"decode.{elem}"] = ("F32", (256,), np_bytes(vals))
    meta = {"format": "moecore-mxfp8-v1", "torch": torch.__version__, "torchao": pkg_version("torchao"),
            "ml_dtypes": pkg_version("ml_dtypes"), "numpy": np.__version__,
            "script": "tools/reference/make_mx_fixtures.py"}
    meta.update({k: str(v) for k, v in summary.items()})
    write(args.out, tensors, meta)
    devs = {k: v for k, v in summary.items() if not k.endswith(".axis") and v}
    print(f"wrote {args.out}: {len(cases)} cases, {len(tensors)} tensors, "
          f"{os.path.getsize(args.out)} bytes; blocks where torchao departs from its rule: {devs}")


if __name__ == "__main__":
    main()
