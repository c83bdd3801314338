"""The dataflow decode step (decode_dataflow.cu) against the persistent one, bit for bit.

The dataflow step runs the persistent step's phase bodies as per-block task lists that wait
on the counters of what they read (rt_llm_node/backends/dataflow_plan.py), so every output
has the same single writer and order of sums: tokens, logits, attention mass and the KV cache
must equal decode_persistent's bit for bit, at any number of lists (the full grid, or 8 and 16
lists as on a Jetson Orin's multiprocessors), over steps that cross the plan's attention
chunks and after compaction. Runs where CuPy sees a GPU (``make gpu-test``).
"""

import numpy as np
import pytest

from rt_llm_node.backends import cuda_available
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.config import ModelConfig
from rt_llm_node.model.synthetic import write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason='no CUDA device (CuPy sees none)')]

SHAPES = ['smollm2-135m', 'qwen2.5-0.5b', 'llama-3.2-1b']
# head_dim 32: the smallest shape the persistent phases take
SMALL = {'family': 'llama', 'vocab_size': 512, 'hidden_size': 128, 'intermediate_size': 160,
         'num_layers': 2, 'num_heads': 4, 'num_kv_heads': 2, 'max_position_embeddings': 2048,
         'tie_word_embeddings': True}


def backend(checkpoint, capacity, lists=0):
    """decode_persistent (lists 0) or decode_dataflow with ``lists`` lists (None: one an SM)."""
    import cupy
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    if lists is None:
        lists = cupy.cuda.Device().attributes['MultiProcessorCount']
    return CudaBackend(checkpoint, capacity,
                       CudaOptions(decode_step='persistent', dataflow_lists=lists))


def run(step, prompt, steps):
    """Tokens, logits, masses and the final KV cache of greedy steps after ``prompt``."""
    step.prefill(prompt)
    tokens, logits, masses = [], [], []
    for _ in range(steps):
        logits.append(step.logits())
        masses.append(step.attention_mass())
        tokens.append(step.argmax())
        step.decode(tokens[-1])
    step.stream.synchronize()   # the last step's cache append, read outside the stream
    length = step.length
    return tokens, logits, masses, (step.k[:, :length].get(), step.v[:, :length].get())


def assert_same(a, b, what):
    assert a[0] == b[0], what
    for i in range(len(a[1])):
        np.testing.assert_array_equal(a[1][i], b[1][i], err_msg=f'{what}: logits, step {i}')
        np.testing.assert_array_equal(a[2][i], b[2][i], err_msg=f'{what}: mass, step {i}')
    np.testing.assert_array_equal(a[3][0], b[3][0], err_msg=f'{what}: keys')
    np.testing.assert_array_equal(a[3][1], b[3][1], err_msg=f'{what}: values')


@pytest.fixture(scope='module')
def shape_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp('shapes')
    return {name: write_random_checkpoint(root / name, name, seed=5) for name in SHAPES}


@pytest.mark.parametrize('shape', SHAPES)
def test_dataflow_step_is_the_persistent_step_bit_for_bit(shape, shape_dirs):
    checkpoint = load_checkpoint(shape_dirs[shape])
    prompt = np.random.default_rng(7).integers(0, checkpoint.config.vocab_size, 60)
    reference = backend(checkpoint, 320)
    assert reference.decode_step == 'persistent'
    expected = run(reference, prompt, 12)   # positions 60 .. 71: past a 64-key chunk
    del reference
    for lists in (0, 8, 16):   # 0: one list a multiprocessor
        step = backend(checkpoint, 320, lists or None)
        assert step.decode_step == 'dataflow'
        assert_same(run(step, prompt, 12), expected, f'{shape}, {lists or "all"} lists')
        # the counters were zeroed by the last block out: a second run is the same
        step.rollback(0)
        assert_same(run(step, prompt, 12), expected, f'{shape}, again')
        del step


def test_dataflow_step_after_compaction_matches_numpy(tmp_path):
    config = ModelConfig(**SMALL)
    checkpoint = load_checkpoint(write_random_checkpoint(tmp_path, config, seed=8))
    rng = np.random.default_rng(8)
    cuda = backend(checkpoint, 128, 8)
    ref = NumpyBackend(checkpoint, 128)
    prompt = rng.integers(0, config.vocab_size, 90)
    keep = np.sort(rng.choice(85, 25, replace=False))
    for b in (cuda, ref):
        b.prefill(prompt)
        b.compact(keep)
    for token in rng.integers(0, config.vocab_size, 20):
        for b in (cuda, ref):
            b.decode(int(token))
        np.testing.assert_allclose(cuda.logits(), ref.logits(), rtol=2e-4, atol=2e-5)
        np.testing.assert_allclose(cuda.attention_mass(), ref.attention_mass(), rtol=1e-4,
                                   atol=1e-6)


def test_options_that_cannot_run_are_refused():
    from rt_llm_node.backends.cuda_backend import CudaOptions
    with pytest.raises(ValueError, match="decode_step 'persistent'"):
        CudaOptions(decode_step='kernels', dataflow_lists=8)
    with pytest.raises(ValueError, match='1 .. 4096'):
        CudaOptions(decode_step='persistent', dataflow_lists=-1)
