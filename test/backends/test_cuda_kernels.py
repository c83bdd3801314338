"""Every CUDA kernel against its numpy twin: fresh random inputs, poisoned outputs.

Runs where CuPy sees a GPU (``make gpu-test``); skipped with the reason elsewhere.
Tolerance: |gpu - ref| <= ATOL + RTOL * |ref| elementwise.
"""

from types import SimpleNamespace

import numpy as np
import pytest

from rt_llm_node.backends import cuda_available
from rt_llm_node.backends.cuda_backend import ATT_QTILE
from rt_llm_node.backends.cuda_backend import ATT_THREADS
from rt_llm_node.backends.cuda_backend import attn_partial_shared
from rt_llm_node.backends.cuda_backend import MASS_KEYS
from rt_llm_node.backends.cuda_backend import MASS_WARPS_PREFILL
from rt_llm_node.backends.cuda_backend import MAX_DYNAMIC_SHARED
from rt_llm_node.backends.cuda_backend import T16_TOKENS
from rt_llm_node.backends.cuda_backend import T16_UNITS
from rt_llm_node.backends.cuda_backend import t16_warps
from rt_llm_node.backends.cuda_backend import VERIFY_NT
from rt_llm_node.backends.numpy_backend import apply_rope
from rt_llm_node.backends.numpy_backend import attention
from rt_llm_node.backends.numpy_backend import rmsnorm
from rt_llm_node.backends.numpy_backend import rope_tables
from rt_llm_node.backends.numpy_backend import silu

from kernel_checks import ATOL  # noqa: I100
from kernel_checks import close
from kernel_checks import i32
from kernel_checks import poisoned
from kernel_checks import weights

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason='no CUDA device (CuPy sees none)')]


@pytest.fixture(scope='module', params=['BF16', 'F16', 'F32'])
def kit(request):
    import cupy as cp
    from rt_llm_node.backends.cuda_kernels import KernelSet
    return cp, KernelSet(request.param), request.param


def state(cp, start, n, token=0, mass_acc=0):
    return cp.asarray(np.array([token, start, n, mass_acc, 0, 0, 0, 0], np.int32))


NULL = np.uint64(0)


def matmul_kernel(k, family, tt):
    """``family`` (e.g. 'matmul_residual') as tt: 1 or 16 (_t1, _t16)."""
    return k.functions[f'{family}_t{tt}']


def matmul_grid(units, split, tt, n_rows=32):
    """Return the grid the backend gives each matmul kernel over ``n_rows`` tokens of x."""
    if tt == 16:      # T16_TOKENS tokens x T16_UNITS units a block, the token tiles first
        return (-(-n_rows // T16_TOKENS), -(-units // T16_UNITS))
    return ((units * split + 3) // 4, n_rows)


def matmul_block(tt, K, grid):
    """Return the block the backend gives a matmul over K: 4 warps, a prefill tile t16_warps.

    A test's grid is small: given 64 multiprocessors, its warps double as far as K allows
    (4 up to K = 224, 8 up to 480, then 16).
    """
    return (32 * (t16_warps(K, grid[0] * grid[1], 64) if tt == 16 else 4),)


def matmul_rows(dtype, tt):
    """Rows of x a matmul test holds."""
    return 32


def matmul_atol(tt):
    return ATOL


def test_embed_gather(kit, rng):
    cp, k, dtype = kit
    table, ref = weights(cp, dtype, (100, 72), rng)
    ids = rng.integers(0, 100, 16).astype(np.int32)
    x = poisoned(cp, (16, 72))
    k.embed_gather((16,), (256,), (state(cp, 0, 11), cp.asarray(ids), table, x, i32(72), i32(0)))
    close(x.get()[:11], ref[ids[:11]], 0, 0)
    assert np.isnan(x.get()[11:]).all(), 'tokens past n must be left alone'
    k.embed_gather((1,), (256,), (state(cp, 0, 1, token=42), cp.asarray(ids), table, x,
                                  i32(72), i32(1)))
    close(x.get()[0], ref[42], 0, 0)


# split: warps sharing a row pair's K (one-token kernels); K = 4104 needs two batches of
# loads per lane in each half, 2600 splits unevenly, 36 takes the scalar path. _t16 (its
# warps as matmul_block gives them): 4 warps (96, 36, 37), 8 (300), 16 with a partial last
# chunk (4104) or on the scalar path (1500), x rows not 16-byte aligned (37), two full token
# tiles of 16 (32)
@pytest.mark.parametrize('n,tt,K,split', [(1, 1, 96, 1), (1, 1, 96, 2), (1, 1, 600, 4),
                                          (1, 1, 4104, 1), (1, 1, 4104, 2), (1, 1, 2600, 4),
                                          (1, 1, 36, 2), (13, 16, 96, 1), (20, 16, 36, 1),
                                          (5, 16, 600, 1), (32, 16, 4104, 1),
                                          (17, 16, 1500, 1), (7, 16, 37, 1),
                                          (9, 16, 300, 1)])
def test_matmul_residual(kit, n, tt, K, split, rng):
    cp, k, dtype = kit
    n_rows = matmul_rows(dtype, tt)
    rows = 77
    w, wf = weights(cp, dtype, (rows, K), rng)
    x = rng.standard_normal((n_rows, K)).astype(np.float32)
    out0 = rng.standard_normal((n_rows, rows)).astype(np.float32)
    out = cp.asarray(out0)
    units = (rows + 1) // 2   # 39: with split 2 or 4 the last block has idle warps
    grid = matmul_grid(units, split, tt, n_rows)
    matmul_kernel(k, 'matmul_residual', tt)(grid, matmul_block(tt, K, grid), (
        state(cp, 3, n), w, i32(rows), i32(K), cp.asarray(x), NULL, np.float32(1e-5), out,
        i32(units), i32(0), i32(split)))
    ref = out0.copy()
    ref[:n] += x[:n] @ wf.T
    close(out.get(), ref, atol=matmul_atol(tt))


@pytest.mark.parametrize('split', [1, 2])
def test_matmul_store_last_token_with_rmsnorm(kit, split, rng):
    cp, k, dtype = kit
    rows, K, n = 301, 512, 9
    w, wf = weights(cp, dtype, (rows, K), rng)
    nw, nwf = weights(cp, dtype, (K,), rng, scale=1.0)
    x = rng.standard_normal((32, K)).astype(np.float32)
    st = state(cp, 0, n)
    out = poisoned(cp, (rows,))
    units = (rows + 1) // 2
    grid = ((units * split + 3) // 4, 1)
    k.matmul_store_t1(grid, (128,), (
        st, w, i32(rows), i32(K), cp.asarray(x), nw, np.float32(1e-5), out, i32(units), i32(1),
        i32(split)))
    close(out.get(), wf @ rmsnorm(x[n - 1:n], nwf, 1e-5)[0])
    assert st.get()[4] == 0
    x[n - 1, 3] = np.inf   # a non-finite logit raises the flag
    k.matmul_store_t1(grid, (128,), (
        st, w, i32(rows), i32(K), cp.asarray(x), nw, np.float32(1e-5), out, i32(units), i32(1),
        i32(split)))
    assert st.get()[4] & 1


# K = 1000: a prefill tile of 8 warps, each summing its share of the squares for the norm
@pytest.mark.parametrize('n,tt,split,K', [(1, 1, 1, 64), (1, 1, 2, 64), (11, 16, 1, 64),
                                          (30, 16, 1, 64), (30, 16, 1, 1000)])
def test_matmul_swiglu(kit, n, tt, split, K, rng):
    cp, k, dtype = kit
    n_rows = matmul_rows(dtype, tt)
    inter = 40
    w, wf = weights(cp, dtype, (2 * inter, K), rng)
    nw, nwf = weights(cp, dtype, (K,), rng, scale=1.0)
    x = rng.standard_normal((n_rows, K)).astype(np.float32)
    act = poisoned(cp, (n_rows, inter))
    grid = matmul_grid(inter, split, tt, n_rows)
    matmul_kernel(k, 'matmul_swiglu', tt)(grid, matmul_block(tt, K, grid), (
        state(cp, 0, n), w, i32(2 * inter), i32(K), cp.asarray(x), nw, np.float32(1e-5), act,
        i32(inter), i32(0), i32(split)))
    gu = rmsnorm(x[:n], nwf, 1e-5) @ wf.T
    close(act.get()[:n], silu(gu[:, :inter]) * gu[:, inter:], atol=matmul_atol(tt))
    assert np.isnan(act.get()[n:]).all(), 'tokens past n must be left alone'


def qkv_case(cp, dtype, n_rows, rng):
    """Make a Q/K/V + RoPE case on the host and the device.

    Weights, input and poisoned outputs of a Q/K/V + RoPE case (4 heads, 2 KV heads of 32, K 512, a
    128-slot cache written from slot 7), on the host and the device.
    """
    c = SimpleNamespace(heads=4, kv=2, d=32, K=512, cap=128, start=7)
    c.rows = (c.heads + 2 * c.kv) * c.d
    c.units = c.rows // 2
    c.w, c.wf = weights(cp, dtype, (c.rows, c.K), rng)
    c.b, c.bf = weights(cp, dtype, (c.rows,), rng)
    c.nw, c.nwf = weights(cp, dtype, (c.K,), rng, scale=1.0)
    c.x = rng.standard_normal((n_rows, c.K)).astype(np.float32)
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, c.d, 2) / c.d))
    c.cos, c.sin = rope_tables(np.arange(-c.cap, c.cap), inv_freq)
    c.q = poisoned(cp, (n_rows, c.heads * c.d))
    c.kc, c.vc = poisoned(cp, (c.cap, c.kv, c.d)), poisoned(cp, (c.cap, c.kv, c.d))
    return c


def qkv_args(cp, c, n, bias, last):
    """Return the kernel's arguments for ``n`` tokens; ``last``: split or per_block (_sp)."""
    return (state(cp, c.start, n), c.w, i32(c.rows), i32(c.K), cp.asarray(c.x), c.nw,
            np.float32(1e-5), i32(c.units), c.b if bias else NULL, c.q, c.kc, c.vc,
            cp.asarray(c.cos), cp.asarray(c.sin), i32(c.heads), i32(c.kv), i32(c.d), i32(c.cap),
            i32(last))


def check_qkv(c, n, bias, atol=ATOL):
    """Check q and the cache slots against numpy.

    q of the n tokens, and their K (rotated) and V in the cache slots from c.start, against numpy;
    every other cache slot untouched.
    """
    h, kv, d = c.heads, c.kv, c.d
    qkv = rmsnorm(c.x[:n], c.nwf, 1e-5) @ c.wf.T + (c.bf if bias else 0)
    cos = c.cos[c.cap + c.start:c.cap + c.start + n]
    sin = c.sin[c.cap + c.start:c.cap + c.start + n]
    close(c.q.get()[:n], apply_rope(qkv[:, :h * d].reshape(n, h, d), cos, sin).reshape(n, -1),
          atol=atol)
    close(c.kc.get()[c.start:c.start + n],
          apply_rope(qkv[:, h * d:(h + kv) * d].reshape(n, kv, d), cos, sin), atol=atol)
    close(c.vc.get()[c.start:c.start + n], qkv[:, (h + kv) * d:].reshape(n, kv, d), atol=atol)
    kc = c.kc.get()
    assert np.isnan(kc[:c.start]).all() and np.isnan(kc[c.start + n:]).all()


@pytest.mark.parametrize('n,tt,bias,split', [(1, 1, True, 1), (1, 1, False, 2),
                                             (10, 16, False, 1), (20, 16, True, 1)])
def test_matmul_qkv_rope_writes_q_and_cache(kit, n, tt, bias, split, rng):
    cp, k, dtype = kit
    n_rows = matmul_rows(dtype, tt)
    c = qkv_case(cp, dtype, n_rows, rng)
    grid = matmul_grid(c.units, split, tt, n_rows)
    matmul_kernel(k, 'matmul_qkv_rope', tt)(grid, (128,), qkv_args(cp, c, n, bias, split))
    check_qkv(c, n, bias, atol=matmul_atol(tt))


# the verify rows' matmuls (_tv, VERIFY_NT tokens a block): ten tokens, three rows of blocks
# (the last one short); xhat read from global memory, or staged in the dynamic shared memory
# the launch gives
# (K = 36 is not in 16-byte chunks: given the memory, the kernel still reads x directly)
@pytest.mark.parametrize('K,split,norm', [(96, 1, True), (600, 4, False), (4104, 2, True),
                                          (36, 2, True)])
@pytest.mark.parametrize('staged_x', [False, True])
def test_verify_matmuls_repeat_the_one_token_kernel_bit_for_bit(kit, K, split, norm,
                                                                staged_x, rng):
    from cupy_backends.cuda.api import driver
    cp, k, dtype = kit
    shared = 4 * VERIFY_NT * K if staged_x else 0
    for name in ('matmul_residual_tv', 'matmul_qkv_rope_tv'):
        driver.funcSetAttribute(k.functions[name].ptr, MAX_DYNAMIC_SHARED,
                                max(shared, 48 * 1024))
    n, rows, start = 10, 77, 5
    units = (rows + 1) // 2
    w, _ = weights(cp, dtype, (rows, K), rng)
    nw = weights(cp, dtype, (K,), rng, scale=1.0)[0] if norm else NULL
    x = rng.standard_normal((n, K)).astype(np.float32)
    out0 = rng.standard_normal((n, rows)).astype(np.float32)

    def residual(family_sfx, tokens, x_rows, out_rows, first):
        out = cp.asarray(out_rows)
        k.functions['matmul_residual' + family_sfx](
            ((units * split + 3) // 4, -(-tokens // (VERIFY_NT if family_sfx == '_tv' else 1))),
            (128,), (state(cp, first, tokens), w, i32(rows), i32(K), cp.asarray(x_rows), nw,
                     np.float32(1e-5), out, i32(units), i32(0), i32(split)),
            shared_mem=shared if family_sfx == '_tv' else 0)
        return out.get()
    rows_tv = residual('_tv', n, x, out0, start)
    for t in range(n):
        one = residual('_t1', 1, x[t:t + 1], out0[t:t + 1], start + t)
        assert np.array_equal(rows_tv[t], one[0]), t
    # q/k/v with RoPE at each token's position
    c = qkv_case(cp, dtype, n, rng)
    grid = ((c.units * split + 3) // 4, -(-n // VERIFY_NT))
    k.matmul_qkv_rope_tv(grid, (128,), qkv_args(cp, c, n, True, split),
                         shared_mem=4 * VERIFY_NT * c.K if staged_x else 0)
    q_tv, kc_tv, vc_tv = c.q.get(), c.kc.get(), c.vc.get()
    x_all = c.x
    for t in range(n):
        c.x, c.start = x_all[t:t + 1], 7 + t
        k.matmul_qkv_rope_t1(((c.units * split + 3) // 4, 1), (128,),
                             qkv_args(cp, c, 1, True, split))
        assert np.array_equal(c.q.get()[0], q_tv[t]), t
        assert np.array_equal(c.kc.get()[7 + t], kc_tv[7 + t]), t
        assert np.array_equal(c.vc.get()[7 + t], vc_tv[7 + t]), t


def staged(k, family, dtype, units, K, per_block, args):
    """Launch ``family``_sp as the backend does (staged_plan).

    A block per ``per_block`` units, their rows, the norm and xhat in dynamic shared memory (past
    48 KB allowed).
    """
    from cupy_backends.cuda.api import driver
    shared = (2 * per_block + 1) * K * (4 if dtype == 'F32' else 2) + 4 * K
    function = k.functions[family + '_sp']
    driver.funcSetAttribute(function.ptr, 8, shared)   # MAX_DYNAMIC_SHARED_SIZE_BYTES
    function((-(-units // per_block),), (128,), args, shared_mem=shared)


# the staged one-token kernels (decode): one unit a block, blocks of several with a short
# last one, K of several 8-weight rounds a lane, and 74-131 KB of shared memory (4104)
@pytest.mark.parametrize('K,per_block,norm', [(96, 1, False), (600, 4, True), (4104, 2, False),
                                              (4104, 3, True)])
def test_matmul_residual_staged(kit, K, per_block, norm, rng):
    cp, k, dtype = kit
    rows = 77
    units = (rows + 1) // 2
    w, wf = weights(cp, dtype, (rows, K), rng)
    nw, nwf = weights(cp, dtype, (K,), rng, scale=1.0)
    x = rng.standard_normal((2, K)).astype(np.float32)
    out0 = rng.standard_normal((2, rows)).astype(np.float32)
    out = cp.asarray(out0)
    staged(k, 'matmul_residual', dtype, units, K, per_block, (
        state(cp, 3, 1), w, i32(rows), i32(K), cp.asarray(x), nw if norm else NULL,
        np.float32(1e-5), out, i32(units), i32(per_block)))
    ref = out0.copy()
    ref[0] += (rmsnorm(x[:1], nwf, 1e-5) if norm else x[:1])[0] @ wf.T
    close(out.get(), ref)


@pytest.mark.parametrize('per_block', [1, 3])
def test_matmul_swiglu_staged(kit, per_block, rng):
    cp, k, dtype = kit
    inter, K = 40, 64
    w, wf = weights(cp, dtype, (2 * inter, K), rng)
    nw, nwf = weights(cp, dtype, (K,), rng, scale=1.0)
    x = rng.standard_normal((2, K)).astype(np.float32)
    act = poisoned(cp, (2, inter))
    staged(k, 'matmul_swiglu', dtype, inter, K, per_block, (
        state(cp, 0, 1), w, i32(2 * inter), i32(K), cp.asarray(x), nw, np.float32(1e-5), act,
        i32(inter), i32(per_block)))
    gu = rmsnorm(x[:1], nwf, 1e-5) @ wf.T
    close(act.get()[:1], silu(gu[:, :inter]) * gu[:, inter:])
    assert np.isnan(act.get()[1:]).all(), 'only the decode token is written'


@pytest.mark.parametrize('bias,per_block', [(True, 5), (False, 1)])
def test_matmul_qkv_rope_staged(kit, bias, per_block, rng):
    cp, k, dtype = kit
    c = qkv_case(cp, dtype, 2, rng)
    staged(k, 'matmul_qkv_rope', dtype, c.units, c.K, per_block,
           qkv_args(cp, c, 1, bias, per_block))
    check_qkv(c, 1, bias)
    assert np.isnan(c.q.get()[1:]).all()


# split_blocks: attn_partial's grid over the splits (None: one block a split); fewer make
# each block loop over several (2 of 4 splits, 3 of 8, 1 of all)
@pytest.mark.parametrize('start,n,d,split_blocks', [
    (0, 1, 64, None), (150, 1, 64, None), (0, 17, 64, None), (70, 33, 64, None),
    (130, 1, 128, None), (40, 9, 32, None), (150, 40, 64, 2), (200, 50, 128, 3),
    (100, 33, 64, 1)])
def test_attention_and_mass(kit, start, n, d, split_blocks, rng):
    cp, k, _ = kit
    heads, kv, cap, n_max = 6, 2, 256, 64 if n > 1 else 1
    chunk = 64 if d <= 64 else 32
    splits = (cap + chunk - 1) // chunk
    q = rng.standard_normal((n_max, heads * d)).astype(np.float32)
    kc = rng.standard_normal((cap, kv, d)).astype(np.float32)
    vc = rng.standard_normal((cap, kv, d)).astype(np.float32)
    st = state(cp, start, n)
    scores = poisoned(cp, (heads, n_max, cap))
    part_ml = poisoned(cp, (heads * n_max, splits, 2))
    part_o = poisoned(cp, (heads * n_max, splits, d))
    out = poisoned(cp, (n_max, heads * d))
    old = rng.random(cap).astype(np.float32)
    mass = cp.asarray(old)
    dq, dk, dv = cp.asarray(q), cp.asarray(kc), cp.asarray(vc)
    tiles = heads * -(-n_max // ATT_QTILE)   # a block takes ATT_QTILE queries of a head
    k.attn_partial((tiles, split_blocks or splits), (ATT_THREADS,), (
        st, dq, dk, dv, NULL, NULL, scores, part_ml, part_o, i32(n_max), i32(heads), i32(kv),
        i32(d),
        i32(cap), i32(splits), i32(chunk), np.float32(1 / np.sqrt(d))),
        shared_mem=attn_partial_shared(chunk, d))
    k.attn_combine((heads * n_max,), (128,), (
        st, part_ml, part_o, out, scores, i32(n_max), i32(heads), i32(d), i32(cap),
        i32(splits), i32(chunk)))
    k.attn_mass((-(-cap // MASS_KEYS),), (32 * MASS_WARPS_PREFILL,), (
        st, scores, NULL, mass, i32(n_max), i32(heads * n_max), i32(cap), i32(1), i32(0)))
    end = start + n
    ref_out, ref_mass = attention(q[:n].reshape(n, heads, d), kc[:end], vc[:end], start)
    close(out.get()[:n], ref_out.reshape(n, -1))
    close(mass.get()[:end], ref_mass)
    close(mass.get()[end:], old[end:], 0, 0)


@pytest.mark.parametrize('start,d,kv', [(0, 64, 2), (200, 64, 2), (77, 32, 6), (130, 128, 1),
                                        (250, 256, 3)])
def test_attn_decode_merges_splits_in_the_last_block(kit, start, d, kv, rng):
    cp, k, _ = kit
    heads, cap = 6, 256
    chunk = 64 if d <= 64 else 32 if d <= 128 else 16
    splits = cap // chunk
    kc = rng.standard_normal((cap, kv, d)).astype(np.float32)
    vc = rng.standard_normal((cap, kv, d)).astype(np.float32)
    counters = cp.zeros(heads, np.int32)
    for _ in range(2):   # twice: the last block of each head must have reset its counter
        q = rng.standard_normal((1, heads * d)).astype(np.float32)
        st = state(cp, start, 1)
        scores = poisoned(cp, (heads, cap))
        part_ml = poisoned(cp, (heads, splits, 2))
        part_o = poisoned(cp, (heads, splits, d))
        out = poisoned(cp, (heads * d,))
        row_ml = poisoned(cp, (heads, 2))
        k.attn_decode((heads, splits), (128,), (
            st, cp.asarray(q), cp.asarray(kc), cp.asarray(vc), NULL, NULL, scores, part_ml,
            part_o, out,
            row_ml, counters, i32(heads), i32(kv), i32(d), i32(cap), i32(splits), i32(chunk),
            np.float32(1 / np.sqrt(d)), i32(0), i32(0)))
        mass = poisoned(cp, (cap,))
        k.attn_mass((-(-cap // MASS_KEYS),), (256,), (
            st, scores, row_ml, mass, i32(1), i32(heads), i32(cap), i32(1), i32(0)))
        ref_out, ref_mass = attention(q.reshape(1, heads, d), kc[:start + 1], vc[:start + 1],
                                      start)
        close(out.get(), ref_out.reshape(-1))
        close(mass.get()[:start + 1], ref_mass)
        assert (counters.get() == 0).all()


def test_attention_mass_adds_up_over_layers_and_chunks(kit, rng):
    cp, k, _ = kit
    rows, cap, n_max = 3 * 4, 128, 4   # 3 layers x (1 head x 4 queries)
    probs = rng.random((rows, cap)).astype(np.float32)
    old = rng.random(cap).astype(np.float32)
    start, n = 20, 3
    for first, acc in ((1, 1), (0, 0)):
        mass = cp.asarray(old)
        k.attn_mass((-(-cap // MASS_KEYS),), (256,), (
            state(cp, start, n, mass_acc=acc), cp.asarray(probs), NULL, mass, i32(n_max),
            i32(rows),
            i32(cap), i32(first), i32(0)))
        t = np.arange(start + n)
        ref = np.zeros(start + n)
        for r in range(rows):
            qi = r % n_max
            if qi < n:
                ref += np.where(t <= start + qi, probs[r, :start + n], 0)
        keep_old = (t < start) if first else np.ones_like(t, bool)
        ref += np.where(keep_old, old[:start + n], 0)
        close(mass.get()[:start + n], ref)
        close(mass.get()[start + n:], old[start + n:], 0, 0)


@pytest.mark.parametrize('start,d,kv', [(0, 64, 2), (190, 64, 2), (61, 128, 1)])
def test_attn_decode_rows_equal_decode_steps_bit_for_bit(kit, start, d, kv, rng):
    """A verify pass's queries (grid.z) give each decode step's output, softmax and mass."""
    cp, k, _ = kit
    heads, cap, rows = 4, 256, 5
    chunk = 64 if d <= 64 else 32
    splits = cap // chunk
    kc = cp.asarray(rng.standard_normal((cap, kv, d)).astype(np.float32))
    vc = cp.asarray(rng.standard_normal((cap, kv, d)).astype(np.float32))
    q = cp.asarray(rng.standard_normal((rows, heads * d)).astype(np.float32))
    scale = np.float32(1 / np.sqrt(d))

    def run(first, n, grid_z):
        st = state(cp, first, n)
        scores = poisoned(cp, (n, heads, cap))
        out = poisoned(cp, (n, heads * d))
        row_ml = poisoned(cp, (n, heads, 2))
        mass = poisoned(cp, (n, cap))
        k.attn_decode((heads, splits, grid_z), (128,), (
            st, q[first - start:], kc, vc, NULL, NULL, scores, poisoned(cp, (n, heads, splits, 2)),
            poisoned(cp, (n, heads, splits, d)), out, row_ml, cp.zeros(n * heads, np.int32),
            i32(heads), i32(kv), i32(d), i32(cap), i32(splits), i32(chunk), scale,
            i32(heads * cap), i32(heads * 2)))
        k.attn_mass((-(-cap // MASS_KEYS), grid_z), (256,), (
            st, scores, row_ml, mass, i32(1), i32(heads), i32(cap), i32(1),
            i32(heads * cap if n > 1 else 0)))
        return out.get(), row_ml.get(), mass.get()
    out, row_ml, mass = run(start, rows, rows)
    for r in range(rows):   # query r as its own decode step at position start + r
        step_out, step_ml, step_mass = run(start + r, 1, 1)
        assert np.array_equal(out[r], step_out[0])
        assert np.array_equal(row_ml[r], step_ml[0])
        assert np.array_equal(mass[r, :start + r + 1], step_mass[0, :start + r + 1])


def test_argmax_rows_takes_each_rows_candidates(kit, rng):
    cp, k, _ = kit
    vocab, rows = 3000, 4
    logits = rng.standard_normal((rows, vocab)).astype(np.float32)
    sets = [None, np.array([5], np.int32), np.sort(rng.choice(vocab, 40, replace=False)),
            None]
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1   # a tie: the smaller id
    flat = np.concatenate([np.zeros(0, np.int32)] + [a for a in sets if a is not None])
    counts = np.array([-1 if a is None else len(a) for a in sets], np.int32)
    offsets = np.concatenate([[0], np.cumsum(np.maximum(counts, 0))[:-1]]).astype(np.int32)
    results = cp.full(rows, -1, np.int32)
    counters = cp.zeros(rows, np.int32)
    for n in (rows, 2):   # twice: counters reset; rows past state n stay untouched
        results.fill(-1)
        k.argmax_rows((64, rows), (256,), (
            state(cp, 0, n), cp.asarray(logits), cp.asarray(flat.astype(np.int32)),
            cp.asarray(offsets), cp.asarray(counts), i32(vocab), poisoned(cp, rows * 64),
            cp.zeros(rows * 64, np.int32), counters, results))
        want = [int(np.argmax(row)) if a is None else int(a[np.argmax(row[a])])
                for row, a in zip(logits, sets)]
        assert results.get().tolist() == want[:n] + [-1] * (rows - n)
        assert (counters.get() == 0).all()


@pytest.mark.parametrize('count', [-1, 1, 7, 5000])
def test_argmax_masked(kit, count, rng):
    cp, k, _ = kit
    vocab = 20000
    logits = rng.standard_normal(vocab).astype(np.float32)
    allowed = np.sort(rng.choice(vocab, max(count, 1), replace=False)).astype(np.int32)
    logits[allowed[-1]] = logits.max() + 1 if count != 1 else logits[allowed[-1]]
    st = state(cp, 0, 1)
    for _ in range(2):  # the done-counter resets itself between launches
        k.argmax_masked((64,), (256,), (
            st, cp.asarray(logits), cp.asarray(allowed), i32(count), i32(vocab),
            poisoned(cp, 64), cp.zeros(64, np.int32)))
        want = int(np.argmax(logits)) if count < 0 else int(allowed[np.argmax(logits[allowed])])
        assert st.get()[5] == want
    tied = np.zeros(vocab, np.float32)
    k.argmax_masked((64,), (256,), (st, cp.asarray(tied), cp.asarray(allowed), i32(-1),
                                    i32(vocab), poisoned(cp, 64), cp.zeros(64, np.int32)))
    assert st.get()[5] == 0, 'ties go to the smallest id'


def test_compact_rerotates_and_moves(kit, rng):
    cp, k, _ = kit
    layers, cap, kv, d, length = 3, 96, 2, 32, 80
    inv_freq = 1.0 / (10000.0 ** (np.arange(0, d, 2) / d))
    cos, sin = rope_tables(np.arange(-cap, cap), inv_freq)
    kk = rng.standard_normal((layers, cap, kv, d)).astype(np.float32)
    vv = rng.standard_normal((layers, cap, kv, d)).astype(np.float32)
    mass0 = rng.random(cap).astype(np.float32)
    keep = np.sort(rng.choice(length, 50, replace=False)).astype(np.int32)
    dk, dv, dm = cp.asarray(kk), cp.asarray(vv), cp.asarray(mass0)
    kt, vt, mt = poisoned(cp, kk.shape), poisoned(cp, vv.shape), poisoned(cp, (cap,))
    args = (cp.asarray(keep), dk, dv, NULL, NULL, dm, kt, vt, NULL, NULL, mt, cp.asarray(cos),
            cp.asarray(sin), i32(cap), i32(kv), i32(d))
    k.compact_gather((len(keep), layers), (128,), args)
    k.compact_store((len(keep), layers), (128,),
                    (dk, dv, NULL, NULL, dm, kt, vt, NULL, NULL, mt, i32(cap), i32(kv), i32(d)))
    m = len(keep)
    delta = cap + np.arange(m) - keep
    for layer in range(layers):
        close(dk.get()[layer, :m], apply_rope(kk[layer, keep], cos[delta], sin[delta]))
        close(dv.get()[layer, :m], vv[layer, keep], 0, 0)
    close(dm.get()[:m], mass0[keep], 0, 0)
