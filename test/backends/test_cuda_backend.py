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
    """Return a CudaBackend with CudaOptions(**options); the kernel decode step unless named."""
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    options.setdefault('decode_step', 'kernels')
    return CudaBackend(checkpoint, capacity, CudaOptions(**options))


def assert_repeatable(backend, checkpoint, steps=24):
    """Return the same 100-token prompt and greedy steps twice.

    Tokens, logits and attention mass equal bit for bit.
    """
    prompt = np.random.default_rng(8).integers(0, checkpoint.config.vocab_size, 100)
    first = run_steps(backend, prompt, steps)
    backend.rollback(0)
    second = run_steps(backend, prompt, steps)
    assert first[1] == second[1]
    for step in range(steps):
        np.testing.assert_array_equal(first[0][step], second[0][step])
        np.testing.assert_array_equal(first[2][step], second[2][step])


def fp32_tiny_checkpoint(directory):
    """Return the tiny shape with fp32 weights of std 0.2 (varied greedy tokens), loaded."""
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


@pytest.mark.parametrize('step', ['kernels', 'persistent'])
@pytest.mark.parametrize('shape', SHAPES)
def test_shapes_match_numpy_backend(shape, step, shape_dirs):
    checkpoint = load_checkpoint(shape_dirs[shape])
    prompt = np.random.default_rng(1).integers(0, checkpoint.config.vocab_size, 150)
    ours = run_steps(cuda_backend(checkpoint, 256, decode_step=step), prompt,
                     4)   # 150 > one prefill chunk
    ref = run_steps(NumpyBackend(checkpoint, 256), prompt, 4)
    for step in range(4):
        assert rel_err(ours[0][step], ref[0][step]) < REL, (shape, step)
        np.testing.assert_allclose(ours[2][step], ref[2][step], rtol=1e-3, atol=1e-4)
    assert ours[1] == ref[1]


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
    """Programmatic dependent launch lets a kernel start before the previous one ends.

    Any read that runs ahead of griddepcontrol.wait would show up as logits that differ from the
    serial launch's, which does the same arithmetic in the same order (bit for bit).
    """
    checkpoint = load_checkpoint(shape_dirs['smollm2-135m'])
    # unstaged: the same kernels both ways
    dependent = cuda_backend(checkpoint, 320, staged_decode=False)
    if dependent.kernels.arch < 90:
        pytest.skip('programmatic dependent launch needs sm_90, '
                    f'this GPU is sm_{dependent.kernels.arch}')
    assert dependent.dependent_launch
    serial = cuda_backend(checkpoint, 320, staged_decode=False, dependent_launch=False)
    assert not serial.dependent_launch
    prompt = np.random.default_rng(6).integers(0, checkpoint.config.vocab_size, 200)
    expected = run_steps(serial, prompt, 24)
    for _ in range(2):
        dependent.rollback(0)
        run = run_steps(dependent, prompt, 24)
        assert run[1] == expected[1]
        for step in range(24):
            np.testing.assert_array_equal(run[0][step], expected[0][step])
            np.testing.assert_array_equal(run[2][step], expected[2][step])


def staged_backend(checkpoint, capacity):
    default = cuda_backend(checkpoint, 16)
    if not default.dependent_launch:
        pytest.skip('staged decode needs programmatic dependent launch (sm_90), this GPU is '
                    f'sm_{default.kernels.arch}')
    del default
    return cuda_backend(checkpoint, capacity, staged_decode=True)


@pytest.mark.parametrize('shape', SHAPES)
def test_staged_decode_matches_numpy_backend(shape, shape_dirs):
    """The staged matmuls match the numpy backend.

    The staged one-token matmuls (weights in shared memory before the wait, the next kernel
    released at once) against the numpy backend, over a 150-token prompt.
    """
    checkpoint = load_checkpoint(shape_dirs[shape])
    backend = staged_backend(checkpoint, 256)
    plans = backend.staged_matmuls()
    default = cuda_backend(checkpoint, 16)
    assert default.staged_decode == all(plans.values()), 'the default: all four or none'
    del default
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
    """Each staged output has one writer and a fixed order of sums.

    Two runs agree bit for bit, however early the next kernels' blocks started.
    """
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
        cuda_backend(checkpoint, 64, dependent_launch=False, staged_decode=True)


def test_auto_decode_keeps_the_faster_step(shape_dirs, tiny_checkpoint):
    """The auto decode step keeps the faster of the two.

    make_backend's CUDA backend (decode_step 'auto') times both decode steps at configure and keeps
    decode_persistent only where it was 3% faster; it is left with an empty cache and gives the
    numpy backend's logits. Where decode_persistent cannot run (tiny: head_dim 16) the kernel step
    stays.
    """
    from rt_llm_node.backends import make_backend
    checkpoint = load_checkpoint(shape_dirs['llama-3.2-1b'])
    backend = make_backend('cuda', checkpoint, 256)
    tuning = backend.decode_tuning
    assert tuning['kernels'] > 0 and tuning['persistent'] > 0, tuning
    faster = tuning['persistent'] <= 0.97 * tuning['kernels']
    assert backend.decode_step == ('persistent' if faster else 'kernels')
    assert tuning['chosen'] == backend.decode_step
    assert backend.length == 0
    prompt = np.random.default_rng(4).integers(0, checkpoint.config.vocab_size, 60)
    ours = run_steps(backend, prompt, 3)
    ref = run_steps(NumpyBackend(checkpoint, 256), prompt, 3)
    for step in range(3):
        assert rel_err(ours[0][step], ref[0][step]) < REL, step
    assert ours[1] == ref[1]
    tiny = make_backend('cuda', load_checkpoint(tiny_checkpoint), 32)
    assert tiny.decode_tuning['persistent'] is None and tiny.decode_step == 'kernels'
    # the node's cuda_decode_step pins either step, untimed
    for step in ('kernels', 'persistent'):
        pinned = make_backend('cuda', checkpoint, 64, step)
        assert pinned.decode_step == step and pinned.decode_tuning is None


# head_dim 32: the smallest shape decode_persistent takes (tiny's head_dim 16 does not)
PERSISTENT_CONFIG = {'family': 'llama', 'vocab_size': 512, 'hidden_size': 128,
                     'intermediate_size': 160, 'num_layers': 2, 'num_heads': 4,
                     'num_kv_heads': 2, 'max_position_embeddings': 2048,
                     'tie_word_embeddings': True}


@pytest.mark.parametrize('shape', SHAPES)
def test_persistent_decode_matches_a_kernel_per_phase(shape, shape_dirs):
    """One cooperative launch per step against the five-kernels-a-layer forward.

    Same tokens, logits and attention mass, over steps that cross a 32-key attention split.
    """
    checkpoint = load_checkpoint(shape_dirs[shape])
    prompt = np.random.default_rng(7).integers(0, checkpoint.config.vocab_size, 60)
    runs = []
    for step in ('kernels', 'persistent'):
        backend = cuda_backend(checkpoint, 320, decode_step=step)
        assert backend.decode_step == step
        runs.append(run_steps(backend, prompt, 8))   # positions 60 .. 67
        del backend
    per_phase, persistent = runs
    assert persistent[1] == per_phase[1]
    for step in range(8):
        assert rel_err(persistent[0][step], per_phase[0][step]) < REL / 10, (shape, step)
        np.testing.assert_allclose(persistent[2][step], per_phase[2][step], rtol=1e-4,
                                   atol=1e-6)


def test_persistent_decode_is_repeatable_bit_for_bit(shape_dirs):
    """A persistent step is repeatable bit for bit.

    Every output of a persistent step has one writer and a fixed order of sums, so two runs of the
    same tokens agree bit for bit, however the blocks were scheduled.
    """
    checkpoint = load_checkpoint(shape_dirs['smollm2-135m'])
    backend = cuda_backend(checkpoint, 320, decode_step='persistent')
    assert_repeatable(backend, checkpoint)


def test_persistent_decode_after_compaction_matches_numpy(tmp_path):
    config = ModelConfig(**PERSISTENT_CONFIG)
    checkpoint = load_checkpoint(write_random_checkpoint(tmp_path, config, seed=8))
    rng = np.random.default_rng(8)
    cuda = cuda_backend(checkpoint, 128, decode_step='persistent')
    ref = NumpyBackend(checkpoint, 128)
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


def test_persistent_decode_fp32_weights_give_identical_greedy_tokens(tmp_path):
    config = ModelConfig(**PERSISTENT_CONFIG)
    weights = {name: w if name.endswith('norm.weight') else 10 * w
               for name, w in random_weights(config, seed=3).items()}
    checkpoint = load_checkpoint(write_checkpoint(tmp_path, config, weights,
                                                  word_tokenizer(config.vocab_size), dtype='F32'))
    cuda = cuda_backend(checkpoint, 128, decode_step='persistent')
    prompt = np.random.default_rng(2).integers(0, config.vocab_size, 40)
    ours = run_steps(cuda, prompt, 24)
    ref = run_steps(NumpyBackend(checkpoint, 128), prompt, 24)
    assert ours[1] == ref[1]


def test_persistent_decode_refuses_shapes_it_cannot_run(tiny_checkpoint):
    from rt_llm_node.backends import BackendError
    from rt_llm_node.backends.cuda_backend import CudaOptions
    checkpoint = load_checkpoint(tiny_checkpoint)   # head_dim 16
    backend = cuda_backend(checkpoint, 32)
    assert backend.decode_step == 'kernels'
    assert 'head_dim 16' in backend.persistent_decode_problem()
    with pytest.raises(BackendError, match='head_dim 16'):
        cuda_backend(checkpoint, 32, decode_step='persistent')
    with pytest.raises(ValueError, match='unknown decode step'):
        CudaOptions(decode_step='ring')


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
    from rt_llm_node.configure import configure_engine
    from rt_llm_node.demo.messages import MessageFactory
    from rt_llm_node.demo.world import DemoWorld
    from rt_llm_node.engine import ModelClock
    from rt_llm_node.generate import main
    from conftest import demo_values
    from conftest import run_ticks
    assert main(['--backend', 'cuda', '--prompt', 'go to the red box', '--max-new-tokens',
                 '8']) == 0
    assert '[cuda]' in capsys.readouterr().err
    clock = ModelClock()
    engine = configure_engine(demo_values(backend='cuda'), clock=clock, log=lambda m: None)
    assert engine.backend.name == 'cuda'
    world = DemoWorld(5, messages=MessageFactory(ros=False))
    for result in run_ticks(engine, clock, world, 60):
        assert result.action is not None, result.refusal
        v, w = result.action.values['linear.x'], result.action.values['angular.z']
        assert math.isfinite(v + w)
        world.step(v, w)


@pytest.mark.parametrize('kv_dtype', ['native', 'int8'])
def test_imported_slots_give_the_prefill_bit_for_bit(tmp_path, kv_dtype):
    """Slots exported and imported (at 0, and after a prefix) continue exactly as prefilled."""
    from rt_llm_node.backends import BackendError
    checkpoint = fp32_tiny_checkpoint(tmp_path)
    prompt = np.random.default_rng(3).integers(0, checkpoint.config.vocab_size, 60)
    source = cuda_backend(checkpoint, 100, kv_dtype=kv_dtype)
    source.prefill(prompt[:40])
    whole, tail = source.export_kv(0, 40), source.export_kv(20, 40)
    assert whole['k'].shape[1] == 40 and tail['k'].shape[1] == 20
    source.prefill(prompt[40:])
    expected = source.logits(), source.attention_mass()
    target = cuda_backend(checkpoint, 100, kv_dtype=kv_dtype)
    assert target.import_kv(whole) == 40
    target.prefill(prompt[40:])
    np.testing.assert_array_equal(target.logits(), expected[0])
    np.testing.assert_array_equal(target.attention_mass(), expected[1])
    target.rollback(20)
    assert target.import_kv(tail, 20) == 40
    target.prefill(prompt[40:])
    np.testing.assert_array_equal(target.logits(), expected[0])
    with pytest.raises(BackendError, match='does not fit'):
        target.import_kv({**whole, 'k': whole['k'].astype(np.float64)})
    with pytest.raises(BackendError, match='cannot import at slot 61'):
        target.import_kv(whole, 61)    # past the cache's end (60)
    with pytest.raises(BackendError, match='does not fit'):
        target.import_kv(source.export_kv(0, 60), 60)   # 120 slots: past the capacity
