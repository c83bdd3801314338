"""The study kernels (probes.cu, benchmarks/bandwidth.cu) against numpy.

They do the work they are timed for. GPU only; run from the repository root:

    PYTHONPATH=. python3 -m pytest -q dev/cuda/test_probes.py

"""

import os
import sys

import numpy as np
import pytest

from rt_llm_node.backends import cuda_available

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, '..', '..', 'test')]   # kernel_checks

from devkit import cluster_launcher  # noqa: E402,I100
from devkit import NON_PORTABLE_CLUSTER_SIZE_ALLOWED  # noqa: E402
from devkit import probe_kernels  # noqa: E402
from kernel_checks import close  # noqa: E402
from kernel_checks import i32  # noqa: E402
from kernel_checks import poisoned  # noqa: E402
from kernel_checks import STORAGE  # noqa: E402
from kernel_checks import weights  # noqa: E402
from probe_layer_floor import floor_reference  # noqa: E402

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not cuda_available(), reason='no CUDA device (CuPy sees none)')]


@pytest.fixture(scope='module', params=['BF16', 'F16', 'F32'])
def kit(request):
    import cupy as cp
    return cp, probe_kernels(request.param), request.param


@pytest.mark.parametrize('per_sm,threads', [(1, 256), (2, 128)])
def test_grid_sync_lets_no_block_pass_early(kit, per_sm, threads):
    """decode_persistent's barrier.

    In each round every block writes the round number, passes the barrier, then reads its
    neighbour's; an early pass reads an older round. 200 launches back to back: each must leave the
    counters at zero for the next (a reset while a block still polls would strand it, and the
    launch would trap).
    """
    cp, k, _ = kit
    from rt_llm_node.backends.cuda_kernels import CooperativeLauncher
    n_sm = cp.cuda.Device().attributes['MultiProcessorCount']
    bar, errors = cp.zeros(2, np.uint32), cp.zeros(1, np.int32)
    slot = cp.zeros(n_sm * per_sm, np.int32)
    stream = cp.cuda.Stream(non_blocking=True)
    launch = CooperativeLauncher()
    for rounds in [500] + [3] * 199:
        launch(k.grid_sync_probe, (n_sm * per_sm,), (threads,),
               (bar, slot, errors, i32(rounds)), 0, stream)
    stream.synchronize()
    assert int(errors.get()[0]) == 0
    assert not bar.get().any()
    assert (slot.get() == 3).all()


@pytest.mark.parametrize('rows,release_first', [(0, 0), (6, 1), (16, 0), (16, 1)])
def test_layer_floor_kernels_compute_the_chain(kit, rows, release_first):
    """The probe kernels of probe_layer_floor.py do the work they are timed for.

    Each phase's vector is the whole previous one normalized (and multiplied by W), in one
    cooperative launch and in a chain of launches under programmatic dependent launch.
    """
    cp, k, dtype = kit
    from rt_llm_node.backends.cuda_kernels import CooperativeLauncher
    from rt_llm_node.backends.cuda_kernels import DependentLauncher
    rng = np.random.default_rng(rows)
    n_sm = cp.cuda.Device().attributes['MultiProcessorCount']
    d, phases = 576, 5
    w, exact = weights(cp, dtype, (d, d), rng, scale=1 / np.sqrt(d))
    x0 = rng.standard_normal(d).astype(np.float32)
    ref = floor_reference(exact if rows else None, x0, phases)
    smem = 4 * d + np.dtype(STORAGE[dtype]).itemsize * rows * d
    stream = cp.cuda.Stream(non_blocking=True)
    bar, sink = cp.zeros(2, np.uint32), cp.zeros(1, np.float32)
    xs = cp.concatenate([cp.asarray(x0), poisoned(cp, d)])
    CooperativeLauncher()(k.layer_floor_probe, (n_sm,), (256,),
                          (bar, xs, w, i32(d), i32(rows), i32(phases), sink), smem, stream)
    stream.synchronize()
    close(xs.get()[d:], ref)
    assert not bar.get().any()
    xs = cp.concatenate([cp.asarray(x0), poisoned(cp, d)])
    launch = DependentLauncher()
    for p in range(phases):
        src, dst = xs[(p % 2) * d:(p % 2 + 1) * d], xs[(1 - p % 2) * d:(2 - p % 2) * d]
        launch(k.layer_floor_step, (n_sm,), (256,),
               (src, dst, w, i32(d), i32(rows), i32(release_first), sink), smem, stream)
    stream.synchronize()
    close(xs.get()[d:], ref)


@pytest.mark.parametrize('grid', [1, 16])
def test_read_sum_wide_reads_every_value_once(kit, grid):
    cp, k, _ = kit
    n = 8 * grid * 1024 * 3
    data = cp.arange(4 * n, dtype=cp.float32) % 7
    out = poisoned(cp, grid)
    k.read_sum_wide((grid,), (1024,), (data, np.int64(n), out))
    assert float(out.get().astype(np.float64).sum()) == float((cp.arange(4 * n) % 7).sum())


def test_layer_floor_splitk_sums_the_blocks_partials(kit):
    """Check the split-K probe against numpy.

    layer_floor_splitk: every block adds x * inv_rms / grid into the next buffer and zeroes its
    rows of the one after; over a chain of 7 launches on three rotating buffers the vector follows
    x <- x / rms(x) (the blocks' partials add up to the whole).
    """
    cp, k, _ = kit
    from rt_llm_node.backends.cuda_kernels import DependentLauncher
    rng = np.random.default_rng(3)
    n_sm = cp.cuda.Device().attributes['MultiProcessorCount']
    d, phases = 896, 7
    x0 = rng.standard_normal(d).astype(np.float32)
    xs = cp.concatenate([cp.asarray(x0), cp.zeros(d, np.float32), poisoned(cp, d)])
    part = [xs[i * d:(i + 1) * d] for i in range(3)]
    stream = cp.cuda.Stream(non_blocking=True)
    launch = DependentLauncher()
    for p in range(phases):
        launch(k.layer_floor_splitk, (n_sm,), (256,),
               (part[p % 3], part[(p + 1) % 3], part[(p + 2) % 3], i32(d)), 0, stream)
    stream.synchronize()
    close(part[phases % 3].get(), floor_reference(None, x0, phases))
    assert not part[(phases + 1) % 3].get().any()   # zeroed by the last launch


@pytest.mark.parametrize('size', [2, 8, 16])
@pytest.mark.parametrize('kind', ['pull', 'push'])
def test_cluster_floor_probe_keeps_the_chain_in_a_cluster(kit, size, kind):
    """Check the cluster probes against numpy.

    cluster_floor_probe (pull: the vector spread over a cluster's shared memories, read through
    DSMEM each round) and cluster_push_probe (push: each block writes its slice into every block's
    copy) follow x <- x / rms(x) in every cluster of the grid.
    """
    cp, k, _ = kit
    from cupy_backends.cuda.api import driver
    if int(cp.cuda.Device().compute_capability) < 90:
        pytest.skip('thread-block clusters need sm_90')
    fn, smem = ((k.cluster_floor_probe, lambda d: 8 * -(-d // size)) if kind == 'pull'
                else (k.cluster_push_probe, lambda d: 8 * d))
    driver.funcSetAttribute(fn.ptr, NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
    rng = np.random.default_rng(size)
    n_sm = cp.cuda.Device().attributes['MultiProcessorCount']
    d, rounds = 576, 9
    x0 = rng.standard_normal(d).astype(np.float32)
    out = poisoned(cp, d)
    stream = cp.cuda.Stream(non_blocking=True)
    cluster_launcher(size)(fn, (size * (n_sm // size),), (256,),
                           (cp.asarray(x0), out, i32(d), i32(rounds)), smem(d), stream)
    stream.synchronize()
    close(out.get(), floor_reference(None, x0, rounds))
