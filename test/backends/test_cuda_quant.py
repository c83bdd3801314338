"""Quantized weights on the CUDA backend: the same greedy tokens as the numpy backend.

GGUF files of every quantized type (and a Q4_K_M-like mix whose fused projections change
format), and HF checkpoints quantized on load (int8, int4), run by both backends on the
same prompts. Runs where CuPy sees a GPU (``make gpu-test``); skipped with the reason
elsewhere.
"""

import numpy as np
import pytest

from gguf_models import prompts  # noqa: I100
from gguf_models import write_gguf

from rt_llm_node.backends import cuda_available  # noqa: I100
from rt_llm_node.backends.numpy_backend import NumpyBackend
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.quant import quantize_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason='no CUDA device (CuPy sees none)')]

PROMPTS = 32
NEW_TOKENS = 16
REL = 2e-3   # max|cuda - numpy| / max|numpy| per step: the same weights, fp32 sums
# With an int8 cache both backends round each key and value to a code; where the two fp32
# values lie on either side of a rounding boundary their codes differ by one step (1/127 of
# the kv head's largest value), which moves logits more than fp32 sums alone: measured on
# the H200, up to 2.4e-3 (Qwen2.5-0.5B shape), the same greedy tokens throughout.
REL_KV_INT8 = 4e-3
MIXED = {'*': 'Q4_K', 'attn_v.weight': 'Q6_K', 'ffn_down.weight': 'Q6_K',
         'token_embd.weight': 'Q6_K'}
CASES = ([(family, kind) for kind in ('Q8_0', 'Q4_0', 'Q4_1', 'Q4_K', 'Q5_K', 'Q6_K')
          for family in ('llama', 'qwen2')] + [('llama', 'mixed'), ('qwen2', 'mixed')])


def cuda_backend(checkpoint, capacity):
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    return CudaBackend(checkpoint, capacity, CudaOptions(decode_step='auto'))


def greedy(backend, ids, steps):
    backend.rollback(0)
    backend.prefill(ids)
    return decode_steps(backend, steps)


def decode_steps(backend, steps):
    """Greedy steps from the backend's state: (logits per step as float64, tokens)."""
    logits, tokens = [], []
    for _ in range(steps):
        logits.append(np.asarray(backend.logits(), np.float64).reshape(-1))
        tokens.append(int(backend.argmax()))
        backend.decode(tokens[-1])
    return logits, tokens


def compare(checkpoint, prompt_list, steps=NEW_TOKENS, capacity=128, cuda=None):
    cuda = cuda or cuda_backend(checkpoint, capacity)
    ref = NumpyBackend(checkpoint, capacity)
    assert cuda.quantized and cuda.decode_step == 'kernels'
    worst = 0.0
    for ids in prompt_list:
        got, want = greedy(cuda, ids, steps), greedy(ref, ids, steps)
        assert got[1] == want[1], (ids, got[1], want[1])
        for a, b in zip(got[0], want[0]):
            worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    assert worst <= REL, worst
    return worst


@pytest.fixture(scope='module')
def files(tmp_path_factory):
    folder = tmp_path_factory.mktemp('gguf')
    return {case: write_gguf(folder / f'{case[0]}_{case[1]}.gguf', case[0],
                             MIXED if case[1] == 'mixed' else case[1],
                             tied=case[0] == 'llama') for case in CASES}


@pytest.mark.parametrize('family, kind', CASES)
def test_gguf_types_give_the_numpy_greedy_tokens(files, family, kind):
    checkpoint = load_checkpoint(files[(family, kind)])
    worst = compare(checkpoint, prompts(checkpoint.tokenizer, PROMPTS))
    print(f'{family} {kind}: worst relative logit difference {worst:.2e}')


@pytest.mark.parametrize('kind', ['Q8_0', 'Q4_0', 'Q4_1'])
def test_fp16_and_fp32_scale_storage_give_the_numpy_greedy_tokens(files, kind, monkeypatch):
    """Both storages of fp16-exact scales (the GPU picks one: stores_half_scales)."""
    from rt_llm_node.backends import cuda_backend as module
    checkpoint = load_checkpoint(files[('llama', kind)])
    prompt_list = prompts(checkpoint.tokenizer, 8)
    sizes = {}
    for half in (0, 1):
        monkeypatch.setattr(module, 'HALF_SCALES', half)
        backend = cuda_backend(checkpoint, 128)
        sizes[half] = backend.weight_bytes()
        compare(checkpoint, prompt_list, cuda=backend)
    assert sizes[1] < sizes[0], sizes


@pytest.mark.parametrize('weight_format', ['int8', 'int4'])
@pytest.mark.parametrize('shape', ['smollm2-135m', 'qwen2.5-0.5b'])
def test_on_load_quantization_gives_the_numpy_greedy_tokens(tmp_path, shape, weight_format):
    checkpoint = quantize_checkpoint(
        load_checkpoint(write_random_checkpoint(tmp_path / shape, shape, seed=5)),
        weight_format)
    rng = np.random.default_rng(8)
    prompt_list = [rng.integers(0, checkpoint.config.vocab_size, n).tolist()
                   for n in (1, 17, 48, 100)]
    compare(checkpoint, prompt_list, steps=8, capacity=256)


def test_quantized_weights_take_fewer_device_bytes(tmp_path):
    path = write_random_checkpoint(tmp_path / 'm', 'smollm2-135m', seed=5)
    sizes = {}
    for fmt in ('int8', 'int4'):
        backend = cuda_backend(quantize_checkpoint(load_checkpoint(path), fmt), 64)
        sizes[fmt] = backend.weight_bytes()
    native = load_checkpoint(path)
    bf16 = sum(t.bits.nbytes for t in native.tensors.values())
    assert sizes['int8'] < 0.6 * bf16 and sizes['int4'] < 0.4 * bf16, (sizes, bf16)


def kv_backends(checkpoint, capacity):
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    return (CudaBackend(checkpoint, capacity, CudaOptions(decode_step='auto', kv_dtype='int8')),
            NumpyBackend(checkpoint, capacity, kv_dtype='int8'))


def run_with_compaction(backend, prompt, steps):
    """Prefill, keep every other slot of the first half (keys re-rotated), decode greedily."""
    backend.rollback(0)
    backend.prefill(prompt)
    n = len(prompt)
    keep = np.concatenate([np.arange(0, n // 2, 2), np.arange(n // 2, n)])
    backend.compact(keep)
    return decode_steps(backend, steps)


@pytest.mark.parametrize('source', ['smollm2-135m', 'qwen2.5-0.5b', 'gguf-Q4_K'])
def test_int8_kv_cache_gives_the_numpy_greedy_tokens(tmp_path, files, source):
    """An int8 cache on both backends: the same tokens after prefill, decode and compaction."""
    if source.startswith('gguf'):
        checkpoint = load_checkpoint(files[('llama', 'Q4_K')])
    else:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp_path / source, source, seed=5))
    cuda, ref = kv_backends(checkpoint, 256)
    assert cuda.decode_step == 'kernels'
    assert cuda.kv_bytes_per_token() == ref.kv_bytes_per_token()
    rng = np.random.default_rng(3)
    worst = 0.0
    for n in (1, 17, 48, 100):
        prompt = rng.integers(0, checkpoint.config.vocab_size, n).tolist()
        for run in (greedy, run_with_compaction) if n > 2 else (greedy,):
            got, want = run(cuda, prompt, 8), run(ref, prompt, 8)
            assert got[1] == want[1], (source, n, run.__name__, got[1], want[1])
            for a, b in zip(got[0], want[0]):
                worst = max(worst, float(np.abs(a - b).max() / np.abs(b).max()))
    assert worst <= REL_KV_INT8, worst


def test_int8_kv_cache_takes_at_most_55_percent_of_the_bytes(tmp_path):
    checkpoint = load_checkpoint(write_random_checkpoint(tmp_path / 'm', 'smollm2-135m', seed=5))
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    native = CudaBackend(checkpoint, 64, CudaOptions(decode_step='kernels'))
    int8 = CudaBackend(checkpoint, 64, CudaOptions(decode_step='kernels', kv_dtype='int8'))
    assert int8.kv_bytes_per_token() <= 0.55 * native.kv_bytes_per_token()
    assert int8.k.nbytes + int8.k_scale.nbytes <= 0.55 * native.k.nbytes


# The one-token kernels directly, one unit of a warp at a time and two (_d2), on grids of 3
# blocks of 128 threads, so that every warp takes many units (the backend's grids hold as
# many warps as are resident and reach more than one unit a warp only on large matrices).
# Row counts are odd or leave the last round short; K leaves some lanes without a second
# chunk (896 and 576 in i8 are 56 and 36 chunks). The two-deep kernels sum in the same order,
# so their outputs equal the others' bit for bit; the residual ones also match numpy.
D2_CASES = [('i8', 1024, 1), ('i8', 896, 1), ('i8', 576, 1), ('i8', 2048, 2),
            ('u4', 2048, 1), ('u4', 896, 1), ('u4', 1024, 2), ('u4', 2048, 4)]


def device_quant(cp, fmt, rows, k, half, rng):
    """Return a random [rows, k] matrix in ``fmt``: (DeviceQuant, its float32 values)."""
    from rt_llm_node.backends.cuda_backend import DeviceQuant
    from rt_llm_node.model.quant import quantize
    tensor = quantize(rng.standard_normal((rows, k)).astype(np.float32) * 0.1, fmt)
    w = DeviceQuant(cp, tensor, half=half)
    assert w.suffix == fmt + ('h' if half else '')   # on-load scales are fp16 values
    return w, tensor.to_float32()


@pytest.fixture(scope='module')
def f32_kernels():
    import cupy as cp
    from rt_llm_node.backends.cuda_backend import MAX_DYNAMIC_SHARED
    from rt_llm_node.backends.cuda_kernels import KernelSet
    from cupy_backends.cuda.api import driver
    k = KernelSet('F32')
    for name, function in k.functions.items():
        if name.startswith('qmatvec_'):
            driver.funcSetAttribute(function.ptr, MAX_DYNAMIC_SHARED, 96 * 1024)
    return cp, k


@pytest.mark.parametrize('half', [True, False])
@pytest.mark.parametrize('fmt, K, split', D2_CASES)
def test_two_deep_kernels_sum_as_the_one_deep_ones(f32_kernels, fmt, K, split, half):
    """Residual, swiglu, store (last token) and q/k/v kernels, plain and _d2."""
    from rt_llm_node.backends.numpy_backend import rmsnorm
    from rt_llm_node.backends.numpy_backend import rope_tables
    cp, k = f32_kernels
    rng = np.random.default_rng(K + split)
    i32, f32 = np.int32, np.float32
    chunks = K // (16 if fmt == 'i8' else 32)
    assert -(-(chunks // split) // 32) <= 2   # the two-deep kernels' contract
    null = np.uint64(0)
    x = rng.standard_normal((1, K)).astype(f32)
    nw = (1 + 0.1 * rng.standard_normal(K)).astype(f32)
    dx, dnw = cp.asarray(x), cp.asarray(nw)
    shared = 4 * (2 * K + K // 16)

    def state():   # one token at position 5
        return np.array([0, 5, 1, 0, 0, 0, 0, 0], np.int32)

    def run(name, args):
        """Both kernels on fresh copies of args' host arrays; return those (state, outputs)."""
        out = {}
        for deep in ('', '_d2'):
            given = args()
            bufs = [cp.asarray(a) if isinstance(a, np.ndarray) else a for a in given]
            kernel = k.functions[f'{name}_{w.suffix}{deep}']
            kernel((3, 1), (128,), tuple(bufs), shared_mem=shared)
            out[deep] = [b.get() for a, b in zip(given, bufs) if isinstance(a, np.ndarray)]
        for a, b in zip(out[''], out['_d2']):
            assert np.array_equal(a, b, equal_nan=True), name
        assert not any(np.isnan(a).any() for a in out['']), name
        return out['']

    # residual (with and without the norm), rows odd: the last unit has one row
    rows = 301
    units = (rows + 1) // 2
    w, wf = device_quant(cp, fmt, rows, K, half, rng)
    out0 = rng.standard_normal((1, rows)).astype(f32)
    for norm in (True, False):
        got = run('qmatvec_residual', lambda: (
            state(), *w.args(), i32(rows), i32(K), dx, dnw if norm else null, f32(1e-5),
            out0.copy(), i32(units), i32(0), i32(split)))[-1]
        xn = rmsnorm(x, nw, 1e-5) if norm else x
        np.testing.assert_allclose(got, out0 + xn @ wf.T, rtol=1e-4, atol=1e-4)
    # swiglu: gate rows, then up rows
    rows = 2 * 190
    w, wf = device_quant(cp, fmt, rows, K, half, rng)
    run('qmatvec_swiglu', lambda: (
        state(), *w.args(), i32(rows), i32(K), dx, dnw, f32(1e-5),
        np.full((1, rows // 2), np.nan, f32), i32(rows // 2), i32(0), i32(split)))
    # store, last token only
    rows = 333
    w, wf = device_quant(cp, fmt, rows, K, half, rng)
    run('qmatvec_store', lambda: (
        state(), *w.args(), i32(rows), i32(K), dx, dnw, f32(1e-5),
        np.full((1, rows), np.nan, f32), i32((rows + 1) // 2), i32(1), i32(split)))
    # q/k/v with RoPE: 6 heads, 2 kv heads of 64
    heads, kv, d, cap = 6, 2, 64, 16
    rows = (heads + 2 * kv) * d
    w, wf = device_quant(cp, fmt, rows, K, half, rng)
    cos, sin = rope_tables(np.arange(-cap, cap), 1e4 ** -(np.arange(0, d, 2) / d))
    dcos, dsin = cp.asarray(cos), cp.asarray(sin)
    got = run('qmatvec_qkv_rope', lambda: (
        state(), *w.args(), i32(rows), i32(K), dx, dnw, f32(1e-5), i32(rows // 2), null,
        np.full((1, heads * d), np.nan, f32), np.zeros((cap, kv * d), f32),
        np.zeros((cap, kv * d), f32), dcos, dsin, i32(heads), i32(kv), i32(d), i32(cap),
        i32(split)))
    v = (rmsnorm(x, nw, 1e-5) @ wf.T)[0, (heads + kv) * d:]
    np.testing.assert_allclose(got[3][5], v, rtol=1e-4, atol=1e-4)   # the cache slot at 5
