"""The CUDA backend end to end: against the numpy backend, HF transformers on the GPU, greedy.

Runs where CuPy sees a GPU (``make gpu-test``); skipped with the reason elsewhere.
"""

import numpy as np
import pytest

from rt_llm_node.backends import cuda_available
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.config import ModelConfig
from rt_llm_node.model.synthetic import random_weights
from rt_llm_node.model.synthetic import shape_config
from rt_llm_node.model.synthetic import word_tokenizer
from rt_llm_node.model.synthetic import write_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason='no CUDA device (CuPy sees none)')]

SHAPES = ['smollm2-135m', 'qwen2.5-0.5b', 'llama-3.2-1b']
REL = 2e-3   # max|ours - ref| / max|ref| per step; both sides sum in fp32


def rel_err(a, b):
    return float(np.max(np.abs(np.asarray(a, np.float64) - b)) / np.max(np.abs(b)))


def cuda_backend(checkpoint, capacity, **options):
    from rt_llm_node.backends.cuda_backend import CudaBackend
    return CudaBackend(checkpoint, capacity, **options)


def assert_repeatable(backend, checkpoint, steps=24):
    """The same 100-token prompt and greedy steps twice: tokens, logits and attention mass
    equal bit for bit."""
    prompt = np.random.default_rng(8).integers(0, checkpoint.config.vocab_size, 100)
    first = run_steps(backend, prompt, steps)
    backend.rollback(0)
    second = run_steps(backend, prompt, steps)
    assert first[1] == second[1]
    for step in range(steps):
        np.testing.assert_array_equal(first[0][step], second[0][step])
        np.testing.assert_array_equal(first[2][step], second[2][step])


def fp32_tiny_checkpoint(directory):
    """The tiny shape with fp32 weights of std 0.2 (varied greedy tokens), loaded."""
    config = shape_config('tiny')
    weights = {name: w if name.endswith('norm.weight') else 10 * w
               for name, w in random_weights(config, seed=9).items()}
    return load_checkpoint(write_checkpoint(directory, config, weights,
                                            word_tokenizer(config.vocab_size), dtype='F32'))


def run_steps(backend, prompt, steps):
    backend.prefill(prompt)
    logits, tokens, masses = [], [], []
    for _ in range(steps):
        logits.append(backend.logits())
        masses.append(backend.attention_mass())
        tokens.append(backend.argmax())
        backend.decode(tokens[-1])
    return logits, tokens, masses


@pytest.fixture(scope='module')
def shape_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp('shapes')
    return {name: write_random_checkpoint(root / name, name, seed=5) for name in SHAPES}


@pytest.mark.parametrize('persistent', [False, True, 'ring'])
@pytest.mark.parametrize('shape', SHAPES)
def test_shapes_match_numpy_backend(shape, persistent, shape_dirs):
    checkpoint = load_checkpoint(shape_dirs[shape])
    prompt = np.random.default_rng(1).integers(0, checkpoint.config.vocab_size, 150)
    ours = run_steps(cuda_backend(checkpoint, 256, persistent_decode=persistent), prompt,
                     4)   # 150 > one prefill chunk
    ref = run_steps(NumpyBackend(checkpoint, 256), prompt, 4)
    for step in range(4):
        assert rel_err(ours[0][step], ref[0][step]) < REL, (shape, step)
        np.testing.assert_allclose(ours[2][step], ref[2][step], rtol=1e-3, atol=1e-4)
    assert ours[1] == ref[1]


@pytest.mark.parametrize('shape', SHAPES)
def test_prefill_on_tensor_cores_matches_numpy_backend(shape, shape_dirs):
    """prefill_mma: the prefill's matmuls on tensor cores (x as a bf16 hi + lo pair) give
    the numpy backend's logits, attention mass and greedy tokens, over two prefill calls of
    150 tokens (three token tiles and a part) and decode steps after them."""
    checkpoint = load_checkpoint(shape_dirs[shape])
    prompt = np.random.default_rng(8).integers(0, checkpoint.config.vocab_size, 150)
    backend = cuda_backend(checkpoint, 512, prefill_mma=True)
    ref_backend = NumpyBackend(checkpoint, 512)
    for _ in range(2):
        ours = run_steps(backend, prompt, 3)
        ref = run_steps(ref_backend, prompt, 3)
        for step in range(3):
            assert rel_err(ours[0][step], ref[0][step]) < REL, (shape, step)
            np.testing.assert_allclose(ours[2][step], ref[2][step], rtol=1e-3, atol=1e-4)
        assert ours[1] == ref[1]


def test_prefill_on_tensor_cores_needs_bf16_weights(tmp_path):
    from rt_llm_node.backends import BackendError
    directory = write_random_checkpoint(tmp_path, 'tiny', dtype='F16')
    with pytest.raises(BackendError, match='prefill_mma needs bf16'):
        cuda_backend(load_checkpoint(directory), 32, prefill_mma=True)


@pytest.mark.parametrize('shape', SHAPES)
def test_shapes_match_transformers_on_the_gpu(shape, shape_dirs):
    torch = pytest.importorskip('torch')
    transformers = pytest.importorskip('transformers')
    torch.backends.cuda.matmul.allow_tf32 = False
    model = transformers.AutoModelForCausalLM.from_pretrained(
        shape_dirs[shape], dtype=torch.float32, attn_implementation='eager').cuda().eval()
    vocab = shape_config(shape).vocab_size
    prompt = np.random.default_rng(2).integers(0, vocab, 40)
    ours = run_steps(cuda_backend(load_checkpoint(shape_dirs[shape]), 128), prompt, 4)
    ids = list(prompt)
    with torch.no_grad():
        for step in range(4):
            ref = model(torch.tensor([ids], device='cuda')).logits[0, -1].double().cpu().numpy()
            assert rel_err(ours[0][step], ref) < REL, (shape, step)
            assert ours[1][step] == int(ref.argmax())
            ids.append(ours[1][step])
    del model
    torch.cuda.empty_cache()


def test_fp32_weights_give_identical_greedy_tokens(tmp_path):
    checkpoint = fp32_tiny_checkpoint(tmp_path)
    config = checkpoint.config
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 30)
    ours = run_steps(cuda_backend(checkpoint, 128), prompt, 32)
    ref = run_steps(NumpyBackend(checkpoint, 128), prompt, 32)
    assert ours[1] == ref[1]
    assert len(set(ref[1])) > 1, 'a constant greedy sequence would prove little'


def test_dependent_launch_changes_timing_not_results(shape_dirs):
    """Programmatic dependent launch lets a kernel start before the previous one ends; any
    read that runs ahead of griddepcontrol.wait would show up as logits that differ from
    the serial launch's, which does the same arithmetic in the same order (bit for bit)."""
    checkpoint = load_checkpoint(shape_dirs['smollm2-135m'])
    backend = cuda_backend(checkpoint, 320, staged_decode=False)   # the same kernels both ways
    if backend.kernels.arch < 90:
        pytest.skip('programmatic dependent launch needs sm_90, '
                    f'this GPU is sm_{backend.kernels.arch}')
    assert backend.dependent_launch
    prompt = np.random.default_rng(6).integers(0, checkpoint.config.vocab_size, 200)
    runs = []
    for enabled in (True, False, True):
        backend.set_dependent_launch(enabled)
        assert backend.dependent_launch == enabled
        runs.append(run_steps(backend, prompt, 24))
    serial = runs[1]
    for run in (runs[0], runs[2]):
        assert run[1] == serial[1]
        for step in range(24):
            np.testing.assert_array_equal(run[0][step], serial[0][step])
            np.testing.assert_array_equal(run[2][step], serial[2][step])


@pytest.mark.parametrize('shape', SHAPES)
def test_grid_stride_changes_the_layout_not_results(shape, shape_dirs):
    """A one-token matmul's warp sums its rows in the same order whatever the grid, so a
    block per row group (False), the resident grid (True) and 3 blocks that each loop over
    hundreds of row groups (the split's shared sums reused round after round, every next
    row's weights loaded while the current one is summed) give the same bits."""
    checkpoint = load_checkpoint(shape_dirs[shape])
    # unstaged: the grid layouts are the streaming one-token kernels'
    backend = cuda_backend(checkpoint, 320, grid_stride=False, staged_decode=False)
    prompt = np.random.default_rng(7).integers(0, checkpoint.config.vocab_size, 100)
    runs = []
    for layout in (False, True, 3):
        backend.set_grid_stride(layout)
        assert backend.grid_stride is layout
        runs.append(run_steps(backend, prompt, 6))
    for run in runs[1:]:
        assert run[1] == runs[0][1]
        for step in range(6):
            np.testing.assert_array_equal(run[0][step], runs[0][0][step])
            np.testing.assert_array_equal(run[2][step], runs[0][2][step])


def staged_backend(checkpoint, capacity):
    backend = cuda_backend(checkpoint, capacity)
    if not backend.dependent_launch:
        pytest.skip('staged decode needs programmatic dependent launch (sm_90), this GPU is '
                    f'sm_{backend.kernels.arch}')
    backend.set_staged_decode(True)
    return backend


@pytest.mark.parametrize('shape', SHAPES)
def test_staged_decode_matches_numpy_backend(shape, shape_dirs):
    """The staged one-token matmuls (weights in shared memory before the wait, the next
    kernel released at once) against the numpy backend, over a 150-token prompt."""
    checkpoint = load_checkpoint(shape_dirs[shape])
    backend = staged_backend(checkpoint, 256)
    plans = backend.staged_matmuls()
    backend.set_staged_decode(None)
    assert backend.staged_decode == all(plans.values()), 'the default: all four or none'
    backend.set_staged_decode(True)
    expected = {'smollm2-135m': {'qkv', 'o', 'gate_up', 'down'},
                'qwen2.5-0.5b': {'qkv', 'o', 'gate_up', 'down'},
                'llama-3.2-1b': {'qkv', 'o'}}[shape] if backend.n_sm >= 100 else None
    if expected is not None:   # an H100/H200-sized chip; fewer SMs stage fewer matrices
        assert {k for k, v in plans.items() if v is not None} == expected, plans
    assert any(plans.values()), 'nothing staged: the test would prove nothing'
    prompt = np.random.default_rng(1).integers(0, checkpoint.config.vocab_size, 150)
    ours = run_steps(backend, prompt, 6)
    ref = run_steps(NumpyBackend(checkpoint, 256), prompt, 6)
    for step in range(6):
        assert rel_err(ours[0][step], ref[0][step]) < REL, (shape, step)
        np.testing.assert_allclose(ours[2][step], ref[2][step], rtol=1e-3, atol=1e-4)
    assert ours[1] == ref[1]


def test_staged_decode_is_repeatable_bit_for_bit(shape_dirs):
    """Each staged output has one writer and a fixed order of sums: two runs agree bit for
    bit, however early the next kernels' blocks started."""
    checkpoint = load_checkpoint(shape_dirs['smollm2-135m'])
    assert_repeatable(staged_backend(checkpoint, 320), checkpoint)


def test_staged_decode_fp32_greedy_tokens_and_compaction(tmp_path):
    checkpoint = fp32_tiny_checkpoint(tmp_path)
    config = checkpoint.config
    backend = staged_backend(checkpoint, 128)
    assert all(backend.staged_matmuls().values()), backend.staged_matmuls()
    ref = NumpyBackend(checkpoint, 128)
    prompt = np.random.default_rng(3).integers(0, config.vocab_size, 30)
    ours, theirs = run_steps(backend, prompt, 32), run_steps(ref, prompt, 32)
    assert ours[1] == theirs[1] and len(set(theirs[1])) > 1
    keep = np.arange(0, 60, 3)
    for b in (backend, ref):
        b.compact(keep)
        b.decode(7)
    assert rel_err(backend.logits(), ref.logits()) < REL


def test_staged_decode_needs_dependent_launch(shape_dirs):
    from rt_llm_node.backends import BackendError
    checkpoint = load_checkpoint(shape_dirs['smollm2-135m'])
    backend = cuda_backend(checkpoint, 64, dependent_launch=False)
    assert not backend.staged_decode, 'the default stages only under dependent launch'
    with pytest.raises(BackendError, match='dependent launch'):
        backend.set_staged_decode(True)
    if backend.kernels.arch >= 90:
        backend.set_dependent_launch(True)
        backend.set_staged_decode(True)
        backend.set_dependent_launch(False)
        assert not backend.staged_decode, 'staged kernels without dependent launch'


def test_auto_decode_keeps_the_faster_step(shape_dirs, tiny_checkpoint):
    """make_backend's CUDA backend (persistent_decode='auto') times both decode steps at
    configure and keeps decode_persistent only where it was 3% faster; it is left with an
    empty cache and gives the numpy backend's logits. Where decode_persistent cannot run
    (tiny: head_dim 16) the kernel step stays."""
    from rt_llm_node.backends import make_backend
    checkpoint = load_checkpoint(shape_dirs['llama-3.2-1b'])
    backend = make_backend('cuda', checkpoint, 256)
    tuning = backend.decode_tuning
    assert tuning['kernels'] > 0 and tuning['persistent'] > 0, tuning
    assert backend.persistent_decode == (tuning['persistent'] <= 0.97 * tuning['kernels'])
    assert tuning['chosen'] == ('persistent' if backend.persistent_decode else 'kernels')
    assert backend.length == 0
    prompt = np.random.default_rng(4).integers(0, checkpoint.config.vocab_size, 60)
    ours = run_steps(backend, prompt, 3)
    ref = run_steps(NumpyBackend(checkpoint, 256), prompt, 3)
    for step in range(3):
        assert rel_err(ours[0][step], ref[0][step]) < REL, step
    assert ours[1] == ref[1]
    tiny = make_backend('cuda', load_checkpoint(tiny_checkpoint), 32)
    assert tiny.decode_tuning['persistent'] is None and not tiny.persistent_decode
    # the node's cuda_decode_step pins either step, untimed
    for step, persistent in (('kernels', False), ('persistent', True)):
        pinned = make_backend('cuda', checkpoint, 64, step)
        assert pinned.persistent_decode == persistent and pinned.decode_tuning is None


# head_dim 32: the smallest shape decode_persistent takes (tiny's head_dim 16 does not)
PERSISTENT_CONFIG = {'family': 'llama', 'vocab_size': 512, 'hidden_size': 128,
                     'intermediate_size': 160, 'num_layers': 2, 'num_heads': 4,
                     'num_kv_heads': 2, 'max_position_embeddings': 2048,
                     'tie_word_embeddings': True}


@pytest.mark.parametrize('kind', ['barrier', 'ring'])
@pytest.mark.parametrize('shape', SHAPES)
def test_persistent_decode_matches_a_kernel_per_phase(shape, kind, shape_dirs):
    """One cooperative launch per step against the five-kernels-a-layer forward: same
    tokens, logits and attention mass, over steps that cross a 32-key attention split."""
    checkpoint = load_checkpoint(shape_dirs[shape])
    backend = cuda_backend(checkpoint, 320, persistent_decode=kind)
    assert backend.persistent_kind == kind, backend.persistent_decode_problem(kind)
    prompt = np.random.default_rng(7).integers(0, checkpoint.config.vocab_size, 60)
    runs = []
    for enabled in (False, kind):
        backend.set_persistent_decode(enabled)
        assert backend.persistent_decode == bool(enabled)
        runs.append(run_steps(backend, prompt, 8))   # positions 60 .. 67
    per_phase, persistent = runs
    assert persistent[1] == per_phase[1]
    for step in range(8):
        assert rel_err(persistent[0][step], per_phase[0][step]) < REL / 10, (shape, step)
        np.testing.assert_allclose(persistent[2][step], per_phase[2][step], rtol=1e-4,
                                   atol=1e-6)


@pytest.mark.parametrize('shape', SHAPES)
def test_ring_decode_barriers_agree_bit_for_bit(shape, shape_dirs):
    """decode_ring with its flag barrier and with the shared counter: logits, tokens and
    attention mass equal bit for bit, and both within REL / 10 of decode_persistent. The
    full-size shapes stream megabytes a block through a ring of ~190 KB: it wraps, fills
    and makes the producer wait (the LM head's chunks)."""
    checkpoint = load_checkpoint(shape_dirs[shape])
    backend = cuda_backend(checkpoint, 320, persistent_decode='barrier')
    prompt = np.random.default_rng(9).integers(0, checkpoint.config.vocab_size, 60)
    barrier = run_steps(backend, prompt, 6)
    runs = []
    for flags in (True, False):
        backend.flag_barrier = flags
        backend.set_persistent_decode('ring')
        assert backend.persistent_kind == 'ring'
        runs.append(run_steps(backend, prompt, 6))
    assert runs[0][1] == runs[1][1] == barrier[1]
    for step in range(6):
        np.testing.assert_array_equal(runs[0][0][step], runs[1][0][step])
        np.testing.assert_array_equal(runs[0][2][step], runs[1][2][step])
        assert rel_err(runs[0][0][step], barrier[0][step]) < REL / 10, step


@pytest.mark.parametrize('kind', ['barrier', 'ring'])
def test_persistent_decode_is_repeatable_bit_for_bit(kind, shape_dirs):
    """Every output of a persistent step has one writer and a fixed order of sums, so two
    runs of the same tokens agree bit for bit, however the blocks were scheduled."""
    checkpoint = load_checkpoint(shape_dirs['smollm2-135m'])
    backend = cuda_backend(checkpoint, 320, persistent_decode=kind)
    assert backend.persistent_kind == kind
    assert_repeatable(backend, checkpoint)


@pytest.mark.parametrize('kind', ['barrier', 'ring'])
def test_persistent_decode_after_compaction_matches_numpy(kind, tmp_path):
    config = ModelConfig(**PERSISTENT_CONFIG)
    checkpoint = load_checkpoint(write_random_checkpoint(tmp_path, config, seed=8))
    rng = np.random.default_rng(8)
    cuda = cuda_backend(checkpoint, 128, persistent_decode=kind)
    ref = NumpyBackend(checkpoint, 128)
    assert cuda.persistent_kind == kind, cuda.persistent_decode_problem(kind)
    prompt = rng.integers(0, config.vocab_size, 90)
    keep = np.sort(rng.choice(85, 25, replace=False))
    tokens = rng.integers(0, config.vocab_size, 70)
    for backend in (cuda, ref):
        backend.prefill(prompt)
        backend.rollback(85)
        backend.compact(keep)
    for step, token in enumerate(tokens):   # lengths 26 .. 95: splits 1 .. 3
        for backend in (cuda, ref):
            backend.decode(int(token))
        assert rel_err(cuda.logits(), ref.logits()) < REL, step
        np.testing.assert_allclose(cuda.attention_mass(), ref.attention_mass(), rtol=1e-3,
                                   atol=1e-4)


def test_ring_decode_fp32_weights_give_identical_greedy_tokens(tmp_path):
    """fp32 weights through decode_ring (8-wide rows of 32 bytes in the ring): the numpy
    backend's greedy tokens."""
    config = ModelConfig(**PERSISTENT_CONFIG)
    weights = {name: w if name.endswith('norm.weight') else 10 * w
               for name, w in random_weights(config, seed=3).items()}
    checkpoint = load_checkpoint(write_checkpoint(tmp_path, config, weights,
                                                  word_tokenizer(config.vocab_size), dtype='F32'))
    cuda = cuda_backend(checkpoint, 128, persistent_decode='ring')
    assert cuda.persistent_kind == 'ring'
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, 40)
    ours = run_steps(cuda, prompt, 24)
    ref = run_steps(NumpyBackend(checkpoint, 128), prompt, 24)
    assert ours[1] == ref[1]


def test_persistent_decode_refuses_shapes_it_cannot_run(tiny_checkpoint):
    from rt_llm_node.backends import BackendError
    checkpoint = load_checkpoint(tiny_checkpoint)   # head_dim 16
    backend = cuda_backend(checkpoint, 32)
    assert not backend.persistent_decode
    assert 'head_dim 16' in backend.persistent_decode_problem()
    with pytest.raises(BackendError, match='head_dim 16'):
        cuda_backend(checkpoint, 32, persistent_decode=True)
    with pytest.raises(BackendError, match='head_dim 16'):
        cuda_backend(checkpoint, 32, persistent_decode='ring')
    with pytest.raises(ValueError, match='persistent_decode must be'):
        cuda_backend(checkpoint, 32, persistent_decode='rings')


@pytest.mark.parametrize('dtype', ['BF16', 'F16'])
def test_compaction_and_rollback_match_numpy(dtype, tmp_path):
    config = shape_config('tiny')
    checkpoint = load_checkpoint(write_random_checkpoint(tmp_path, config, dtype=dtype, seed=4))
    rng = np.random.default_rng(4)
    backends = [cuda_backend(checkpoint, 96), NumpyBackend(checkpoint, 96)]
    prompt = rng.integers(0, config.vocab_size, 80)
    keep = np.sort(rng.choice(80, 40, replace=False))
    more = rng.integers(0, config.vocab_size, 20)
    results = []
    for backend in backends:
        backend.prefill(prompt)
        backend.rollback(75)
        backend.compact(keep[keep < 75])
        mass_after_compact = backend.attention_mass()
        backend.prefill(more)
        backend.decode(7)
        results.append((backend.logits(), backend.attention_mass(), mass_after_compact,
                        backend.length))
    (a, ma, ca, la), (b, mb, cb, lb) = results
    assert la == lb
    assert rel_err(a, b) < REL
    np.testing.assert_allclose(ma, mb, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(ca, cb, rtol=1e-3, atol=1e-4)


def test_constrained_argmax_and_errors(tiny_checkpoint):
    from rt_llm_node.backends import BackendError
    from rt_llm_node.backends import CacheOverflowError
    checkpoint = load_checkpoint(tiny_checkpoint)
    backend = cuda_backend(checkpoint, 16)
    backend.prefill([1, 2, 3])
    logits = backend.logits()
    allowed = np.array([5, 9, 100, 300])
    assert backend.argmax(allowed) == int(allowed[np.argmax(logits[allowed])])
    with pytest.raises(BackendError):
        backend.decode(checkpoint.config.vocab_size)
    with pytest.raises(CacheOverflowError):
        backend.prefill(list(range(14)))
    with pytest.raises(BackendError):
        backend.compact([2, 1])


def test_generate_cli_and_engine_on_cuda(capsys):
    import math
    from pathlib import Path
    import yaml
    from rt_llm_node.configure import configure_engine
    from rt_llm_node.demo.messages import MessageFactory
    from rt_llm_node.demo.world import DemoWorld
    from rt_llm_node.engine import ModelClock
    from rt_llm_node.generate import main
    from rt_llm_node.params import PARAMETERS
    assert main(['--backend', 'cuda', '--prompt', 'go to the red box', '--max-new-tokens',
                 '8']) == 0
    assert '[cuda]' in capsys.readouterr().err
    values = {p.name: p.default for p in PARAMETERS}
    config = Path(__file__).resolve().parents[1] / 'config' / 'demo.yaml'
    values.update(yaml.safe_load(config.read_text())['rt_llm_node']['ros__parameters'])
    values['backend'] = 'cuda'
    clock = ModelClock()
    engine = configure_engine(values, clock=clock, log=lambda m: None)
    assert engine.backend.name == 'cuda'
    world = DemoWorld(5, messages=MessageFactory(ros=False))
    snap = {}
    for i in range(60):
        now = i / 30
        clock.advance_to(now)
        snap.update({t: (m, now) for t, m in world.observe().items()})
        result = engine.tick(snap, now, now + 1 / 30)
        assert result.action is not None, result.refusal
        v, w = result.action.values['linear.x'], result.action.values['angular.z']
        assert math.isfinite(v + w)
        world.step(v, w)
