"""What the studies in dev/cuda share: their kernels, the cluster launcher, the timers.

The probe kernels (probes.cu) and the bandwidth kernels (benchmarks/bandwidth.cu) are built
by the runtime's loader, with its options and headers, but are not part of the node's
program. Run the scripts from the repository root with ``PYTHONPATH=.``.
"""

from pathlib import Path
import sys

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path.insert(0, str(ROOT / 'benchmarks'))

from bench_cuda import time_decode_replay  # noqa: E402,F401  (re-exported for the scripts)

CLUSTER_DIMENSION = 4                    # CUlaunchAttributeID, cuda.h
NON_PORTABLE_CLUSTER_SIZE_ALLOWED = 14   # CUfunction_attribute, cuda.h: clusters of 9-16
PROBES = ('grid_sync_probe', 'layer_floor_probe', 'layer_floor_step', 'layer_floor_splitk',
          'cluster_floor_probe', 'cluster_push_probe', 'read_sum', 'read_sum_wide')


def chain_us(backend, launch, name, grid, block, args, kwargs, chain, repeats=10):
    """GPU us of one launch of kernel ``name``: ``chain`` of them captured back to back in a graph.

    ``launch`` is the backend's own _launch (as the forward calls it); the run state must be
    written before. Median over ``repeats`` replays (CUDA events), divided by ``chain``.
    """
    import cupy as cp
    import numpy as np
    stream = backend.stream
    with stream:
        stream.begin_capture()
        for _ in range(chain):
            launch(name, grid, block, *args, **kwargs)
        graph = stream.end_capture()
    graph.upload(stream)
    start, stop, times = cp.cuda.Event(), cp.cuda.Event(), []
    for _ in range(repeats):
        start.record(stream)
        graph.launch(stream)
        stop.record(stream)
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / chain)
    return float(np.median(times))


def probe_kernels(weight_dtype):
    """Return the probe and bandwidth kernels for ``weight_dtype``, loaded (needs a GPU)."""
    from rt_llm_node.backends.cuda_kernels import KernelSet
    files = [HERE / 'probes.cu', ROOT / 'benchmarks' / 'bandwidth.cu']
    return KernelSet(weight_dtype, files=files, names=PROBES)


def cluster_launcher(size):
    """Launch a kernel in thread-block clusters of ``size`` blocks along x (sm_90 and later).

    More than 8 needs the kernel's non-portable cluster size attribute set.
    """
    import ctypes
    from rt_llm_node.backends.cuda_kernels import LaunchWithAttribute
    launcher = LaunchWithAttribute(CLUSTER_DIMENSION)
    dims = (ctypes.c_uint * 3)(int(size), 1, 1)
    ctypes.memmove(ctypes.addressof(launcher._attribute.value), dims, ctypes.sizeof(dims))
    return launcher
