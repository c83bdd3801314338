"""Compaction re-rotates keys exactly: logits equal a fresh prefill of the kept tokens.

A fresh prefill of the kept tokens reproduces the cache only where keys and
values do not depend on the evicted tokens: in layer 0 of any model. So the
logits comparison runs on one-layer models (where it is exact whatever is
evicted), and multi-layer models are checked layer 0 by layer 0 plus a
round-trip through every layer.
"""

import numpy as np
import pytest

from hf_models import build_hf_model
from hf_models import CASES
from hf_models import save_hf_checkpoint
from hf_models import VOCAB
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.kvcache import make_policy
from rt_llm_node.kvcache import OBSERVATION
from rt_llm_node.kvcache import SYSTEM
from rt_llm_node.model import load_checkpoint
from rt_llm_node.session import KVSession

TOLERANCE = 1e-4


@pytest.fixture(scope='module', params=['llama3_rope_scaling', 'qwen2_bias_untied'])
def checkpoint(request, tmp_path_factory):
    """Return a one-layer model: its cache is a function of each token and its position alone."""
    family, kwargs = CASES[request.param]
    kwargs = dict(kwargs, num_hidden_layers=1)
    directory = tmp_path_factory.mktemp(request.param)
    return load_checkpoint(save_hf_checkpoint(build_hf_model(family, kwargs, seed=5), directory))


@pytest.fixture(scope='module')
def deep_checkpoint(tmp_path_factory):
    family, kwargs = CASES['llama3_rope_scaling']
    kwargs = dict(kwargs, num_hidden_layers=3)
    directory = tmp_path_factory.mktemp('deep')
    return load_checkpoint(save_hf_checkpoint(build_hf_model(family, kwargs, seed=6), directory))


def fresh_logits(checkpoint, token_ids, next_token):
    backend = NumpyBackend(checkpoint, 128)
    backend.prefill(token_ids)
    backend.decode(next_token)
    return backend.logits()


def relative_error(a, b):
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def compacted(checkpoint, rng, n, kept):
    """Return a backend that prefilled ``n`` random tokens, then kept ``kept`` of them."""
    ids = rng.integers(0, VOCAB, n)
    backend = NumpyBackend(checkpoint, 64)
    backend.prefill(ids)
    keep = np.sort(rng.choice(n, size=kept, replace=False))
    backend.compact(keep)
    return backend, ids, keep


def test_compacting_random_slots_equals_fresh_prefill(checkpoint, rng):
    backend, ids, keep = compacted(checkpoint, rng, 60, 25)
    assert backend.length == 25
    backend.decode(17)
    err = relative_error(backend.logits(), fresh_logits(checkpoint, ids[keep], 17))
    assert err < TOLERANCE, err


def test_meaning_eviction_then_decode_equals_fresh_prefill(checkpoint, rng):
    """Evict a stale observation through KVSession, then compare with the kept tokens."""
    backend = NumpyBackend(checkpoint, 48)
    context = KVSession(backend, make_policy('meaning'))
    context.append(rng.integers(0, VOCAB, 8), kind=SYSTEM)
    stale = context.append(rng.integers(0, VOCAB, 12), kind=OBSERVATION, topic='/scan')
    context.append(rng.integers(0, VOCAB, 12), kind=OBSERVATION, topic='/odom')
    context.append(rng.integers(0, VOCAB, 12), kind=OBSERVATION, topic='/scan')
    assert context.length == 44
    context.append(rng.integers(0, VOCAB, 10), kind=OBSERVATION, topic='/odom')  # must evict
    assert stale.uid not in context.cache.segments, 'the superseded /scan goes first'
    assert context.length == 42
    kept = context.cache.token_ids[:context.length].copy()
    segment = context.open_segment()
    context.decode(segment, 5)
    err = relative_error(backend.logits(), fresh_logits(checkpoint, kept, 5))
    assert err < TOLERANCE, err


def test_rollback_then_decode_equals_never_having_run(checkpoint, rng):
    ids = rng.integers(0, VOCAB, 20)
    backend = NumpyBackend(checkpoint, 64)
    context = KVSession(backend, make_policy('meaning'))
    context.append(ids, kind=SYSTEM)
    mark = context.mark()
    context.append(rng.integers(0, VOCAB, 15), kind=OBSERVATION, topic='/scan')
    context.rollback(mark)
    assert context.length == 20 and len(context.cache.segments) == 1
    context.decode(context.open_segment(), 9)
    err = relative_error(backend.logits(), fresh_logits(checkpoint, ids, 9))
    assert err < TOLERANCE, err


def test_deep_model_layer0_cache_equals_fresh_prefill(deep_checkpoint, rng):
    backend, ids, keep = compacted(deep_checkpoint, rng, 50, 30)
    fresh = NumpyBackend(deep_checkpoint, 64)
    fresh.prefill(ids[keep])
    np.testing.assert_allclose(backend.kv.k[0, :30], fresh.kv.k[0, :30], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(backend.kv.v[0, :30], fresh.kv.v[0, :30], rtol=1e-5, atol=1e-5)


def test_deep_model_rotation_round_trip_in_every_layer(deep_checkpoint, rng):
    """Moving keys to new positions and back restores them, in every layer."""
    backend = NumpyBackend(deep_checkpoint, 64)
    backend.prefill(rng.integers(0, VOCAB, 40))
    keep = np.arange(20, 40)
    before = backend.kv.k[:, keep].copy()
    backend.compact(keep)  # positions 20..39 -> 0..19
    from rt_llm_node.backends.numpy_backend import apply_rope
    from rt_llm_node.backends.numpy_backend import rope_tables
    cos, sin = rope_tables(keep - np.arange(20), backend.inv_freq)
    for layer in range(deep_checkpoint.config.num_layers):
        restored = apply_rope(backend.kv.k[layer, :20], cos, sin)
        np.testing.assert_allclose(restored, before[layer], rtol=1e-5, atol=1e-5)
