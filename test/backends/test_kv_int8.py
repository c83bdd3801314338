"""The int8 KV cache on the numpy backend: rounding bounds, compaction, bytes, greedy tokens."""

import numpy as np
import pytest

from rt_llm_node.backends import make_backend
from rt_llm_node.backends.numpy_backend import apply_rope
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.backends.numpy_backend import quantize_kv
from rt_llm_node.backends.numpy_backend import rope_tables
from rt_llm_node.model import load_checkpoint


@pytest.fixture(scope='module')
def checkpoint(tiny_checkpoint):
    return load_checkpoint(tiny_checkpoint)


def dequantized(backend, layer, end):
    return backend.kv.read(layer, end)


def test_codes_are_within_half_a_step_of_the_values(rng):
    x = rng.standard_normal((40, 2, 32)).astype(np.float32) * rng.uniform(0.01, 10, (40, 2, 1))
    x[3, 1] = 0.0   # a zero head: scale 0, codes 0, exact
    codes, scale = quantize_kv(x)
    assert codes.dtype == np.int8 and scale.dtype == np.float32
    err = np.abs(codes * scale[..., None] - x)
    assert np.all(err <= 0.5 * scale[..., None] * (1 + 1e-6))
    assert np.all(np.abs(codes) <= 127) and scale[3, 1] == 0 and not codes[3, 1].any()


def test_the_cache_holds_what_a_native_cache_holds_up_to_the_rounding(checkpoint, rng):
    ids = rng.integers(0, checkpoint.config.vocab_size, 50)
    native, int8 = NumpyBackend(checkpoint, 64), NumpyBackend(checkpoint, 64, kv_dtype='int8')
    native.prefill(ids[:1])   # the first layer's keys and values depend on the tokens only
    int8.prefill(ids[:1])
    k, v = dequantized(int8, 0, 1)
    k_ref, v_ref = dequantized(native, 0, 1)
    step = np.abs(k_ref).max(axis=-1, keepdims=True) / 127
    assert np.all(np.abs(k - k_ref) <= 0.5 * step * (1 + 1e-5))
    assert int8.kv_bytes_per_token() <= 0.55 * native.kv_bytes_per_token()
    cfg = checkpoint.config
    assert int8.kv_bytes_per_token() == cfg.num_layers * 2 * cfg.num_kv_heads * (cfg.head_dim + 4)


def test_compaction_rerotates_keys_exactly_up_to_the_rounding(checkpoint, rng):
    """Compaction's keys are the kept keys, dequantized, rotated and quantized again."""
    backend = NumpyBackend(checkpoint, 64, kv_dtype='int8')
    backend.prefill(rng.integers(0, checkpoint.config.vocab_size, 40))
    keep = np.sort(rng.choice(40, 25, replace=False))
    before = [dequantized(backend, layer, 40) for layer in range(checkpoint.config.num_layers)]
    backend.compact(keep)
    cos, sin = rope_tables(np.arange(25) - keep, backend.inv_freq)
    for layer, (k_old, v_old) in enumerate(before):
        k, v = dequantized(backend, layer, 25)
        want = apply_rope(k_old[keep], cos, sin)
        step = np.abs(want).max(axis=-1, keepdims=True) / 127
        assert np.all(np.abs(k - want) <= 0.5 * step * (1 + 1e-4) + 1e-7)
        np.testing.assert_array_equal(v, v_old[keep])   # values move as stored


def test_greedy_tokens_stay_close_to_the_native_cache(checkpoint, rng):
    """Not identical (the rounding is real), but the logits stay near the native run's."""
    ids = rng.integers(0, checkpoint.config.vocab_size, 30)
    native = make_backend('numpy', checkpoint, 64)
    int8 = make_backend('numpy', checkpoint, 64, kv_dtype='int8')
    for backend in (native, int8):
        backend.prefill(ids)
    a, b = native.logits(), int8.logits()
    assert np.abs(a - b).max() <= 0.05 * np.abs(a).max()


def test_an_unknown_kv_dtype_is_refused(checkpoint):
    with pytest.raises(ValueError, match="kv_dtype 'fp8'"):
        make_backend('numpy', checkpoint, 64, kv_dtype='fp8')
