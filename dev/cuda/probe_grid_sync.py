"""Cost of one grid-wide barrier (cuda/grid_sync.cuh grid_sync) on this GPU.

    PYTHONPATH=. python3 dev/cuda/probe_grid_sync.py

For 1 and 2 blocks per SM (256 and 128 threads), launches grid_sync_probe cooperatively with
0 and N barriers, directly and replayed from a CUDA graph, checks that no block passed a
barrier early, and prints microseconds per barrier.
"""

import numpy as np


def main():
    import cupy as cp
    from cupy_backends.cuda.api import driver

    from rt_llm_node.backends.cuda_kernels import CooperativeLauncher
    from devkit import probe_kernels
    kernels = probe_kernels('BF16')
    fn = kernels.functions['grid_sync_probe']
    n_sm = cp.cuda.Device().attributes['MultiProcessorCount']
    coop = CooperativeLauncher()
    stream = cp.cuda.Stream(non_blocking=True)
    bar = cp.zeros(2, np.uint32)   # arrivals, blocks out
    slot = cp.zeros(4 * n_sm, np.int32)
    errors = cp.zeros(1, np.int32)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    rounds = 2000
    print(f'{n_sm} SMs; {rounds} barriers a launch')
    print('| blocks | threads | resident per SM | direct us/barrier | graph us/barrier | errors |')
    print('|---|---|---|---|---|---|')
    for per_sm, threads in ((1, 256), (2, 128), (1, 512)):
        resident = driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.ptr, threads, 0)
        grid = (n_sm * per_sm,)

        def launch(n):
            coop(fn, grid, (threads,), (bar, slot, errors, np.int32(n)), 0, stream)

        def timed(run, repeats=5):
            out = []
            for _ in range(repeats):
                slot.fill(0)
                stream.synchronize()
                start.record(stream)
                run()
                stop.record(stream)
                stop.synchronize()
                out.append(cp.cuda.get_elapsed_time(start, stop) * 1e3)
            return float(np.median(out))
        errors.fill(0)
        launch(1)
        stream.synchronize()
        direct = (timed(lambda: launch(rounds)) - timed(lambda: launch(0))) / rounds
        graphs = {}
        for n in (0, rounds):
            with stream:
                stream.begin_capture()
                launch(n)
                graphs[n] = stream.end_capture()
        graph = (timed(lambda: graphs[rounds].launch(stream))
                 - timed(lambda: graphs[0].launch(stream))) / rounds
        print(f'| {grid[0]} | {threads} | {resident} | {direct:.3f} | {graph:.3f} | '
              f'{int(errors.get()[0])} |')
        assert not bar.get().any(), 'the barrier counters were not reset'


if __name__ == '__main__':
    main()
