"""Grouped integer weights: the runtime formats, GGUF blocks converted into them, RTN quantizing.

A weight matrix [rows, K] in a runtime format is integer codes ``q`` with, for each group of
``group`` consecutive columns of a row, an fp32 ``scale`` and an fp32 ``offset``:

    w = q * scale + offset        (one fp32 multiply, one fp32 add)

``i8``: one signed byte a code (-128..127), groups of 16 or 32; ``u4``: two codes a byte
(0..15, the even column in the low nibble), groups of 32. ``offset`` may be absent (all zero:
``offsets is None``), which saves its 4 bytes a group.

Every GGUF type this package reads converts into one of them with the same fp32 arithmetic
ggml's own dequantization does, so every weight is the same fp32 number (a zero's sign
aside; tested against the ``gguf`` package):

    Q8_0  d * q, q int8, 32 a block                 -> i8/32, scale d
    Q6_K  (d * sc_j) * (q - 32), 16 a sub-block      -> i8/16, scale d * sc_j (exact in fp32:
                                                       an fp16 times an int8)
    Q5_K  (d * sc_j) * q - dmin * m_j, q 0..31       -> i8/32, offset -(dmin * m_j)
    Q4_0  d * (q - 8), q 0..15                       -> u4/32, offset -8 d (q d and 8 d are
                                                       exact, so q d - 8 d rounds once, like
                                                       (q - 8) d)
    Q4_1  d * q + m                                  -> u4/32, offset m
    Q4_K  (d * sc_j) * q - dmin * m_j                -> u4/32, offset -(dmin * m_j)

A K-quant's 256-value super-block carries fp16 ``d`` and ``dmin`` and 6-bit per-sub-block
``sc_j``, ``m_j``; the runtime format stores their products, a few bytes more a group for
one multiply-add a weight in the kernels.
"""

from dataclasses import dataclass
from typing import Optional

import numpy as np

QK_K = 256
FORMATS = ('i8', 'u4')


@dataclass
class QuantTensor:
    """One matrix in a runtime format (see the module docstring)."""

    fmt: str                      # 'i8' or 'u4'
    shape: tuple                  # (rows, K)
    group: int                    # columns a group: 16 or 32
    codes: np.ndarray             # i8: int8 [rows, K]; u4: uint8 [rows, K // 2]
    scales: np.ndarray            # float32 [rows, K // group]
    offsets: Optional[np.ndarray]  # float32 [rows, K // group], or None (all zero)
    source: str = ''              # the GGUF type or on-load format it came from

    dtype = 'QUANT'   # as StoredTensor.dtype: what the checkpoint checks key on

    def __post_init__(self):
        rows, k = self.shape
        if (self.fmt not in FORMATS or self.group not in (16, 32) or k % self.group
                or (self.fmt == 'u4' and self.group != 32)):
            raise ValueError(f'bad runtime format {self.fmt}/{self.group} for {self.shape}')

    def int_codes(self):
        """Return the codes as an int array [rows, K] (u4 unpacked)."""
        if self.fmt == 'i8':
            return self.codes
        rows, k = self.shape
        out = np.empty((rows, k), np.uint8)
        out[:, 0::2] = self.codes & 0x0F
        out[:, 1::2] = self.codes >> 4
        return out

    def to_float32(self):
        """Dequantize to a new float32 array of ``shape``: q * scale + offset, in fp32."""
        rows, k = self.shape
        q = self.int_codes().astype(np.float32).reshape(rows, k // self.group, self.group)
        w = q * self.scales[:, :, None]
        if self.offsets is not None:
            w += self.offsets[:, :, None]
        return w.reshape(rows, k)

    def rows(self, index):
        """Return the same format restricted to the rows ``index`` (an index array)."""
        return QuantTensor(self.fmt, (len(index), self.shape[1]), self.group,
                           self.codes[index], self.scales[index],
                           None if self.offsets is None else self.offsets[index], self.source)

    @property
    def nbytes(self):
        """Bytes the format occupies (codes, scales and offsets)."""
        return int(self.codes.nbytes + self.scales.nbytes
                   + (0 if self.offsets is None else self.offsets.nbytes))


def _f16(raw):
    return raw.copy().view(np.float16).astype(np.float32)


def _k_scale_min(scales):
    """6-bit sub-block scales and mins of Q4_K/Q5_K: [n, 12] bytes -> two [n, 8] arrays."""
    s = scales.reshape(-1, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = np.concatenate([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _pack_u4(q):
    """[rows, K] values 0..15 -> [rows, K // 2] bytes, the even column in the low nibble."""
    return (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8)


def _q8_0(b, rows, k):
    d = _f16(b[:, :2])
    q = b[:, 2:].copy().view(np.int8)
    return 'i8', 32, q.reshape(rows, k), d.reshape(rows, -1), None


def _q4_0(b, rows, k):
    d = _f16(b[:, :2])
    qs = b[:, 2:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)   # block order: low nibbles first
    return ('u4', 32, _pack_u4(q.reshape(rows, k)), d.reshape(rows, -1),
            (np.float32(-8) * d).reshape(rows, -1))


def _q4_1(b, rows, k):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    qs = b[:, 4:]
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)
    return 'u4', 32, _pack_u4(q.reshape(rows, k)), d.reshape(rows, -1), m.reshape(rows, -1)


def _q4_k(b, rows, k):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 0x0F).reshape(rows, k)
    return ('u4', 32, _pack_u4(q), (d * sc).reshape(rows, -1),
            (-(dmin * mn)).reshape(rows, -1))


def _q5_k(b, rows, k):
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _k_scale_min(b[:, 4:16])
    qh = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    ql = b[:, 48:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    q = (ql & 0x0F).reshape(-1, 8, 32) | ((qh & 0x01) << 4).reshape(-1, 8, 32)
    return ('i8', 32, q.reshape(rows, k).astype(np.int8), (d * sc).reshape(rows, -1),
            (-(dmin * mn)).reshape(rows, -1))


def _q6_k(b, rows, k):
    ql, qh = b[:, :128], b[:, 128:192]
    sc = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d = _f16(b[:, 208:210])
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)) & 0x0F
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)) & 3
    q = (low.reshape(-1, 8, 32) | (high.reshape(-1, 8, 32) << 4)).astype(np.int16) - 32
    return 'i8', 16, q.astype(np.int8).reshape(rows, k), (d * sc).reshape(rows, -1), None


# GGUF type name -> (values a block, bytes a block, converter)
GGUF_QUANT = {
    'Q8_0': (32, 34, _q8_0),
    'Q4_0': (32, 18, _q4_0),
    'Q4_1': (32, 20, _q4_1),
    'Q4_K': (QK_K, 144, _q4_k),
    'Q5_K': (QK_K, 176, _q5_k),
    'Q6_K': (QK_K, 210, _q6_k),
}


def from_gguf_blocks(type_name, blocks, shape):
    """Convert GGUF blocks (uint8 [rows, K / block * bytes]) of ``shape`` into a QuantTensor."""
    block, size, convert = GGUF_QUANT[type_name]
    rows, k = shape
    if k % block:
        raise ValueError(f'{type_name} needs rows of a multiple of {block} values, not {k}')
    b = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(rows * (k // block), size)
    with np.errstate(invalid='ignore', over='ignore'):   # NaN and inf: the loader's check
        fmt, group, codes, scales, offsets = convert(b, rows, k)
        if offsets is not None and not np.any(offsets):
            offsets = None
    return QuantTensor(fmt, (rows, k), group, np.ascontiguousarray(codes),
                       np.ascontiguousarray(scales, np.float32),
                       None if offsets is None else np.ascontiguousarray(offsets, np.float32),
                       type_name)


def _as_half(values, *more):
    """Return ``values`` (and ``more``) rounded to fp16 values, or unchanged.

    Rounded where every one becomes a normal fp16 or zero (relative error at most 2^-11).
    """
    arrays = (values, *more)
    with np.errstate(over='ignore'):   # past fp16's range: inf, then kept as they are
        rounded = tuple(a.astype(np.float16).astype(np.float32) for a in arrays)
    ok = all(np.all(np.isfinite(r)) and np.all(np.abs(r - a) <= np.abs(a) * 2.0 ** -11)
             for r, a in zip(rounded, arrays))
    return rounded if ok else arrays


def quantize(weight, fmt, group=32):
    """Round-to-nearest quantize a float32 matrix [rows, K] per group of ``group`` columns.

    ``i8``: symmetric, scale = max|w| / 127, no offset. ``u4``: asymmetric, scale =
    (max - min) / 15, offset = min. Scales and offsets are rounded to fp16 values first, as
    GGUF's Q8_0 and Q4_1 store them (the CUDA backend keeps such ones in 2 bytes, not 4),
    unless that would leave the fp16 range; the codes are then rounded against them. K must
    be a multiple of ``group``.
    """
    w = np.asarray(weight, np.float32)
    rows, k = w.shape
    if k % group:
        raise ValueError(f'{fmt} quantizing needs rows of a multiple of {group} values, not {k}')
    g = w.reshape(rows, k // group, group)
    if fmt == 'i8':
        scale, = _as_half(np.abs(g).max(axis=-1) / np.float32(127))
        inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        q = np.clip(np.rint(g * inv[..., None]), -127, 127).astype(np.int8)
        return QuantTensor('i8', (rows, k), group, q.reshape(rows, k),
                           scale.astype(np.float32), None, 'int8')
    if fmt == 'u4':
        lo, hi = g.min(axis=-1), g.max(axis=-1)
        half_lo, = _as_half(lo)
        scale, lo = _as_half((hi - half_lo) / np.float32(15), half_lo)
        inv = np.divide(1.0, scale, out=np.zeros_like(scale), where=scale > 0)
        q = np.clip(np.rint((g - lo[..., None]) * inv[..., None]), 0, 15).astype(np.uint8)
        return QuantTensor('u4', (rows, k), group, _pack_u4(q.reshape(rows, k)),
                           scale.astype(np.float32), lo.astype(np.float32), 'int4')
    raise ValueError(f'unknown runtime format {fmt!r}')


WEIGHT_FORMATS = {'native': None, 'int8': 'i8', 'int4': 'u4'}


def quantize_checkpoint(checkpoint, weight_format):
    """Quantize a checkpoint's float matrices in place (``weight_format``: WEIGHT_FORMATS).

    Every 2-D tensor (the projections, the embedding and an untied head) still in a float
    dtype becomes ``int8`` (i8, groups of 32, symmetric) or ``int4`` (u4, groups of 32, scale
    and offset), round to nearest; norms and biases stay as stored, and so do tensors already
    quantized (a GGUF's). ``native`` changes nothing. Returns the checkpoint.
    """
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f'unknown weight_format {weight_format!r} '
                         f'(choose from {", ".join(WEIGHT_FORMATS)})')
    fmt = WEIGHT_FORMATS[weight_format]
    if fmt is None:
        return checkpoint
    for name, tensor in list(checkpoint.tensors.items()):
        if tensor.dtype == 'QUANT' or len(tensor.shape) != 2:
            continue
        if tensor.shape[1] % 32:
            raise ValueError(f'weight_format {weight_format} needs rows of a multiple of 32 '
                             f"values; tensor '{name}' has {tensor.shape[1]}")
        checkpoint.tensors[name] = quantize(tensor.to_float32(), fmt)
    return checkpoint


def concat_rows(tensors):
    """Stack QuantTensors of one K by rows, in a format every part converts into exactly.

    All u4 with groups of 32 stay u4; otherwise i8 (a u4 code 0..15 is an i8 code) with the
    smallest group (a group of 32 is two of 16 with its scale and offset repeated), with
    offsets where any part has them (zeros elsewhere). What a fused projection needs when a
    GGUF mixes types (a Q4_K_M file's Q6_K v beside Q4_K q and k).
    """
    k = tensors[0].shape[1]
    if any(t.shape[1] != k for t in tensors):
        raise ValueError('concat_rows needs one row length')
    if all(t.fmt == 'u4' and t.group == 32 for t in tensors):
        fmt, group = 'u4', 32
    else:
        fmt, group = 'i8', min(t.group for t in tensors)
    with_offsets = any(t.offsets is not None for t in tensors)
    codes, scales, offsets = [], [], []
    for t in tensors:
        rows = t.shape[0]
        c = t.codes if fmt == 'u4' else t.int_codes().astype(np.int8)
        repeat = t.group // group
        s = np.repeat(t.scales, repeat, axis=1)
        o = (np.repeat(t.offsets, repeat, axis=1) if t.offsets is not None
             else np.zeros((rows, k // group), np.float32))
        codes.append(c)
        scales.append(s)
        offsets.append(o)
    return QuantTensor(fmt, (sum(t.shape[0] for t in tensors), k), group,
                       np.ascontiguousarray(np.concatenate(codes)),
                       np.ascontiguousarray(np.concatenate(scales), np.float32),
                       np.ascontiguousarray(np.concatenate(offsets), np.float32)
                       if with_offsets else None,
                       '+'.join(sorted({t.source for t in tensors})))
