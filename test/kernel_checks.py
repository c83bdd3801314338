"""What every kernel test shares (style: llm.c's dev/cuda checks).

Random weights stored in the kernels' dtype with their exact fp32 values, outputs poisoned
with NaN before a run, and the check |got - ref| <= atol + rtol * |ref| elementwise.
"""

import numpy as np

from rt_llm_node.model.synthetic import encode_bits

ATOL, RTOL = 1e-4, 1e-4
STORAGE = {'BF16': np.uint16, 'F16': np.uint16, 'F32': np.float32}


def close(got, ref, atol=ATOL, rtol=RTOL):
    """Assert that ``got`` matches ``ref`` elementwise; name the worst element if not."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    assert got.shape == ref.shape
    bad = np.abs(got - ref) > atol + rtol * np.abs(ref)
    worst = np.unravel_index(np.argmax(np.abs(got - ref)), got.shape)
    assert not bad.any(), (f'{bad.sum()} of {bad.size} off; worst '
                           f'{np.abs(got - ref)[worst]:.3e} at {worst}')


def weights(cp, dtype, shape, rng, scale=0.2):
    """Return random weights stored as ``dtype``: (device array, the same values in fp32)."""
    w = (rng.standard_normal(shape) * scale).astype(np.float32)
    raw = np.frombuffer(encode_bits(w, dtype), STORAGE[dtype]).reshape(shape)
    if dtype == 'BF16':
        exact = (raw.astype(np.uint32) << 16).view(np.float32)
    elif dtype == 'F16':
        exact = raw.view(np.float16).astype(np.float32)
    else:
        exact = raw.copy()
    return cp.asarray(raw), exact


def poisoned(cp, shape):
    """Return a device array of NaN: an output element a kernel never wrote stays NaN."""
    return cp.full(shape, np.nan, np.float32)


def i32(v):
    return np.int32(v)
