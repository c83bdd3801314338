"""The CUDA backend's verify pass: each row exactly a decode step; speculation stays greedy.

Runs where CuPy sees a GPU (``make gpu-test``); skipped with the reason elsewhere.
"""

import numpy as np
import pytest

from rt_llm_node.backends import BackendError
from rt_llm_node.backends import cuda_available
from rt_llm_node.demo.evaluate import HELD_OUT_SEED0
from rt_llm_node.demo.evaluate import run_model_episode
from rt_llm_node.demo.task import model_aim
from rt_llm_node.demo.task import model_inputs
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.embedded import default_model_path
from rt_llm_node.model.quant import quantize_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason='no CUDA device (CuPy sees none)')]


def cuda_backend(checkpoint, capacity, **options):
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    return CudaBackend(checkpoint, capacity, CudaOptions(**options))


@pytest.fixture(scope='module')
def smollm2(tmp_path_factory):
    return write_random_checkpoint(tmp_path_factory.mktemp('smollm2'), 'smollm2-135m', seed=5)


@pytest.mark.parametrize('weights,kv_dtype', [('native', 'native'), ('native', 'int8'),
                                              ('int8', 'native'), ('int4', 'native')])
def test_verify_rows_equal_decode_steps_bit_for_bit(smollm2, weights, kv_dtype):
    checkpoint = quantize_checkpoint(load_checkpoint(smollm2), weights)
    vocab = checkpoint.config.vocab_size
    # ten rows: three rows of blocks of the float kernels (VERIFY_NT = 4 tokens a block),
    # the last one short
    backend = cuda_backend(checkpoint, 192, verify_tokens=10, kv_dtype=kv_dtype)
    assert backend.decode_step == 'kernels' and not backend.staged_decode
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, vocab, 100)
    feed = rng.integers(0, vocab, 10)
    allowed = [None] + [np.sort(rng.choice(vocab, 24, replace=False)) for _ in range(9)]
    backend.prefill(prompt)
    logits, masses, chosen = [], [], []
    for token, ok in zip(feed, allowed):   # the decode steps
        backend.decode(int(token))
        logits.append(backend.logits())
        masses.append(backend.attention_mass())
        chosen.append(backend.argmax(ok))
    stepped_kv = backend.export_kv(100, 110)
    backend.rollback(3)   # something else in between: the rows do not depend on it
    backend.prefill(prompt[3:])
    predicted = backend.verify(feed, allowed)
    assert predicted.tolist() == chosen
    for row in range(10):
        np.testing.assert_array_equal(backend.row_mass(row), masses[row])
    np.testing.assert_array_equal(backend.logits(), logits[-1])
    for name, values in backend.export_kv(100, 110).items():
        np.testing.assert_array_equal(values, stepped_kv[name], err_msg=name)
    # rolled back into the rows: that row's logits and mass, then on as after its step
    backend.rollback(103)
    np.testing.assert_array_equal(backend.logits(), logits[2])
    np.testing.assert_array_equal(backend.attention_mass(), masses[2])
    assert backend.argmax(allowed[2]) == chosen[2]
    with pytest.raises(BackendError):
        backend.row_mass(3)
    backend.decode(int(feed[3]))
    np.testing.assert_array_equal(backend.logits(), logits[3])
    # a compaction right after a verify moves the current row's mass
    backend.rollback(100)
    backend.verify(feed[:4], allowed[:4])
    backend.rollback(102)
    keep = np.arange(0, 102, 2)
    backend.compact(keep)
    np.testing.assert_array_equal(backend.attention_mass(), masses[1][keep])


@pytest.mark.parametrize('weights,kv_dtype,n_prefill', [
    ('native', 'native', 48), ('native', 'native', 150), ('native', 'native', 1),
    ('native', 'int8', 30), ('int8', 'native', 48), ('int4', 'native', 17)])
def test_fused_pass_equals_prefill_then_decode_steps(smollm2, weights, kv_dtype, n_prefill):
    """prefill_verify: the prefill and the verify rows beside it, each exactly as alone."""
    checkpoint = quantize_checkpoint(load_checkpoint(smollm2), weights)
    vocab = checkpoint.config.vocab_size
    backend = cuda_backend(checkpoint, 320, verify_tokens=6, kv_dtype=kv_dtype)
    rng = np.random.default_rng(2)
    base = rng.integers(0, vocab, 90)
    ids, drafts = rng.integers(0, vocab, n_prefill), rng.integers(0, vocab, 6)
    allowed = [np.sort(rng.choice(vocab, 24, replace=False)) for _ in range(6)] + [None]
    backend.prefill(base)
    backend.prefill(ids)   # the plain calls: prefill, then a decode step a draft
    logits, masses = [backend.logits()], [backend.attention_mass()]
    chosen = [backend.argmax(allowed[0])]
    for token, ok in zip(drafts, allowed[1:]):
        backend.decode(int(token))
        logits.append(backend.logits())
        masses.append(backend.attention_mass())
        chosen.append(backend.argmax(ok))
    end = 90 + n_prefill
    stepped_kv = backend.export_kv(90, end + 6)
    backend.rollback(90)
    predicted = backend.prefill_verify(ids, drafts, allowed)
    rows = len(predicted)   # a one-token prefill: one verify pass of at most verify_tokens
    assert rows == (6 if n_prefill == 1 else 7)
    assert predicted.tolist() == chosen[:rows]
    assert backend.length == end + rows - 1
    for row in range(rows):
        np.testing.assert_array_equal(backend.row_mass(row), masses[row])
    np.testing.assert_array_equal(backend.logits(), logits[rows - 1])
    for name, values in backend.export_kv(90, end + rows - 1).items():
        np.testing.assert_array_equal(values, stepped_kv[name][:, :n_prefill + rows - 1],
                                      err_msg=name)
    backend.rollback(end)   # back to the prefill's end: what prefill left
    np.testing.assert_array_equal(backend.logits(), logits[0])
    np.testing.assert_array_equal(backend.attention_mass(), masses[0])
    backend.decode(int(drafts[0]))
    np.testing.assert_array_equal(backend.logits(), logits[1])


def test_verify_refuses_what_it_cannot_run(smollm2):
    from rt_llm_node.backends.cuda_backend import CudaOptions
    checkpoint = load_checkpoint(smollm2)
    vocab = checkpoint.config.vocab_size
    backend = cuda_backend(checkpoint, 64, verify_tokens=3)
    backend.prefill([1, 2, 3])
    with pytest.raises(BackendError, match='verify_tokens'):
        backend.verify([1, 2, 3, 4], [None] * 4)
    with pytest.raises(BackendError, match='allowed sets'):
        backend.verify([1, 2], [None])
    with pytest.raises(BackendError, match='outside the vocabulary'):
        backend.verify([1, 2], [None, np.array([vocab])])
    with pytest.raises(BackendError, match='allows 0 ids'):
        backend.verify([1, 2], [None, np.array([], np.int64)])
    assert backend.length == 3
    with pytest.raises(BackendError, match='verify_tokens'):
        backend.prefill_verify([4, 5], [1, 2, 3, 4], [None] * 5)
    with pytest.raises(BackendError, match='allowed sets'):
        backend.prefill_verify([4, 5], [1, 2], [None] * 2)
    with pytest.raises(BackendError, match='do not fit'):
        backend.prefill_verify(np.ones(60, np.int64), [1, 2], [None] * 3)
    assert backend.length == 3
    with pytest.raises(ValueError, match='verify_tokens'):
        CudaOptions(verify_tokens=4, decode_step='persistent')
    with pytest.raises(ValueError, match='verify_tokens'):
        CudaOptions(verify_tokens=99)
    plain = cuda_backend(checkpoint, 64, decode_step='kernels')
    with pytest.raises(BackendError, match='verify_tokens'):
        plain.verify([1, 2], [None, None])


def test_the_demo_acts_the_same_with_speculation_on_cuda():
    """Held-out demo episodes on the GPU: the same actions, tick for tick, in fewer passes."""
    path = default_model_path()
    checkpoint = load_checkpoint(path)
    backend = cuda_backend(checkpoint, 256, verify_tokens=5)
    runs = {}
    for tokens in (0, 4):
        runs[tokens] = [run_model_episode(checkpoint, seed, 'meaning', 256, backend=backend,
                                          inputs=model_inputs(path), aim=model_aim(path),
                                          speculative_tokens=tokens, max_ticks=150)
                        for seed in range(HELD_OUT_SEED0, HELD_OUT_SEED0 + 4)]
    for plain, drafted in zip(runs[0], runs[4]):
        assert plain['actions'] == drafted['actions']
        assert plain['results'] == drafted['results']
    passes = {tokens: sum(sum(r['passes']) for r in run) for tokens, run in runs.items()}
    accepted = sum(r['accepted'] for r in runs[4])
    assert accepted > 0 and passes[4] < passes[0], (passes, accepted)
