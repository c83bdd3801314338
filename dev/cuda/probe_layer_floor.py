"""Lower bounds for one decode step on this GPU, from what the step cannot avoid.

    PYTHONPATH=. python3 dev/cuda/probe_layer_floor.py [--shapes smollm2-135m,...]
        [--phases 2,3,5] [--repeats 20] [--write]

1. Read bandwidth by the number of SMs that read (read_sum_wide, one 1024-thread block an
   SM, 8 loads in flight a thread), and how long each shape's weights take at that rate:
   the floor of a design that keeps the step on a few SMs (a thread-block cluster, say) to
   make its synchronization cheap.
2. The phase skeleton (probes.cu layer_floor_probe / layer_floor_step): a step of
   layers x P + 1 phases (the last one the LM head), where each phase only does what no
   multi-SM design can skip: wait for the whole activation vector, read it from L2, reduce
   it (RMSNorm) and write the block's share of the next one. With `work` = share, every
   block also multiplies its share of the layer's weights (bytes / SMs / P, capped at what
   fits in shared memory) from shared memory. Cooperative: one launch with a grid barrier
   before each phase, the weights copied in once at the start (so no weight traffic is
   counted). Kernels: a graph of one launch a phase under programmatic dependent launch,
   each launch copying its rows in (cp.async) before it waits for the previous one, and
   letting the next one start after that wait or (released first) before it. Only the
   `none` rows are floors; the `share` rows' sums are a plain warp-per-row-pair loop. P = 2
   is the fewest phases a layer can have: attention and the MLP each need the whole
   normalized vector that the layer before them summed over every SM. Split-K kernels
   (layer_floor_splitk, `none` rows only): every block adds a partial of the whole next
   vector (red.global.add) instead of writing its own rows, the hand-off a phase fused
   across a split K would pay (SwiGLU + down, or o_proj split by head). Outputs are checked
   against numpy.
3. The same phase inside a thread-block cluster, by cluster size: what an exchange costs
   that never leaves a cluster (q, k, v to attention within a KV group's cluster, say).
   Pulled (cluster_floor_probe: the vector spread over the cluster's shared memories, read
   through DSMEM, a cluster barrier a round) and pushed (cluster_push_probe: every block
   holds the whole vector and writes its slice into each block's copy, then the barrier).
"""

import argparse
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from devkit import cluster_launcher  # noqa: E402
from devkit import NON_PORTABLE_CLUSTER_SIZE_ALLOWED  # noqa: E402
from devkit import probe_kernels  # noqa: E402
from report import markdown_table  # noqa: E402
from report import print_table  # noqa: E402
from report import write_section  # noqa: E402
from rt_llm_node.model.synthetic import shape_config  # noqa: E402

SMEM_CAP = 200 * 1024   # dynamic shared memory a probe block may take


def layer_bytes(config, bytes_per_weight=2):
    h, i, q, kv = config.hidden_size, config.intermediate_size, config.q_size, config.kv_size
    return bytes_per_weight * (h * (q + 2 * kv) + q * h + 3 * h * i)


def model_bytes(config, bytes_per_weight=2):
    return (config.num_layers * layer_bytes(config, bytes_per_weight)
            + bytes_per_weight * config.vocab_size * config.hidden_size)


def floor_reference(w, x, phases):
    """Compute the numpy twin of `phases` floor phases.

    Each phase is x <- (W x or x) / rms(x); ``w`` None means rows = 0. The probe tests check
    the kernels against it.
    """
    x = x.astype(np.float64)
    for _ in range(phases):
        inv = 1.0 / np.sqrt(np.mean(x * x) + 1e-6)
        x = (w.astype(np.float64) @ x if w is not None else x) * inv
    return x


class Floor:
    """The probe kernels on one device, with their buffers."""

    def __init__(self, dtype='BF16'):
        import cupy as cp
        from rt_llm_node.backends.cuda_kernels import CooperativeLauncher
        from rt_llm_node.backends.cuda_kernels import DependentLauncher
        self.cp = cp
        self.k = probe_kernels(dtype)
        self.n_sm = cp.cuda.Device().attributes['MultiProcessorCount']
        self.coop, self.dependent = CooperativeLauncher(), DependentLauncher()
        self.stream = cp.cuda.Stream(non_blocking=True)
        self.bar = cp.zeros(2, np.uint32)
        self.sink = cp.zeros(1, np.float32)
        from cupy_backends.cuda.api import driver
        from rt_llm_node.backends.cuda_backend import MAX_DYNAMIC_SHARED
        for name in ('layer_floor_probe', 'layer_floor_step'):
            driver.funcSetAttribute(self.k.functions[name].ptr, MAX_DYNAMIC_SHARED, SMEM_CAP)

    def own(self, d):
        return math.ceil(d / self.n_sm)

    def buffers(self, d, rng):
        from rt_llm_node.model.synthetic import encode_bits
        w = (rng.standard_normal((d, d)) / np.sqrt(d)).astype(np.float32)
        raw = np.frombuffer(encode_bits(w, 'BF16'), np.uint16).reshape(d, d)
        exact = (raw.astype(np.uint32) << 16).view(np.float32)
        x0 = rng.standard_normal(d).astype(np.float32)
        return self.cp.asarray(raw), exact, x0

    def vector(self, x0):
        """Return the ping-pong buffer [2, d] with x0 in its first half."""
        xs = self.cp.zeros(2 * x0.size, np.float32)
        xs[:x0.size] = self.cp.asarray(x0)
        return xs

    def graph(self, cooperative, xs, w, d, rows, phases, release_first=0):
        """Capture a step of floor phases.

        A CUDA graph of one cooperative launch of `phases` phases, or of `phases` layer_floor_step
        launches (the ping-pong of xs); phase p reads half p % 2.
        """
        with self.stream:
            self.stream.begin_capture()
            if cooperative:
                self.coop(self.k.layer_floor_probe, (self.n_sm,), (256,),
                          (self.bar, xs, w, np.int32(d), np.int32(rows), np.int32(phases),
                           self.sink), 4 * d + 2 * rows * d, self.stream)
            for p in range(0 if cooperative else phases):
                src, dst = xs[(p % 2) * d:(p % 2 + 1) * d], xs[(1 - p % 2) * d:(2 - p % 2) * d]
                self.dependent(self.k.layer_floor_step, (self.n_sm,), (256,),
                               (src, dst, w, np.int32(d), np.int32(rows),
                                np.int32(release_first), self.sink),
                               4 * d + 2 * rows * d, self.stream)
            return self.stream.end_capture()

    def splitk_graph(self, xs, d, phases):
        """Capture a chain of split-K launches.

        A CUDA graph of `phases` layer_floor_splitk launches over the three buffers of xs ([3, d]):
        launch p reads p % 3, adds into (p + 1) % 3 and zeroes (p + 2) % 3.
        """
        part = [xs[i * d:(i + 1) * d] for i in range(3)]
        with self.stream:
            self.stream.begin_capture()
            for p in range(phases):
                self.dependent(self.k.layer_floor_splitk, (self.n_sm,), (256,),
                               (part[p % 3], part[(p + 1) % 3], part[(p + 2) % 3], np.int32(d)),
                               0, self.stream)
            return self.stream.end_capture()

    def time_us(self, graph, repeats, batch=20):
        """Time graph replays back to back.

        Median over `repeats` batches of the mean GPU time of `batch` replays back to back (the GPU
        never waits for the host between them).
        """
        cp = self.cp
        start, stop = cp.cuda.Event(), cp.cuda.Event()
        graph.launch(self.stream)
        self.stream.synchronize()
        out = []
        for _ in range(repeats):
            start.record(self.stream)
            for _ in range(batch):
                graph.launch(self.stream)
            stop.record(self.stream)
            stop.synchronize()
            out.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / batch)
        return float(np.median(out))


def check(floor, d, rows, phases, rng):
    """Both kinds against numpy for one size; raises on a mismatch."""
    w, exact, x0 = floor.buffers(d, rng)
    ref = floor_reference(exact if rows else None, x0, phases)
    for cooperative, release_first in ((True, 0), (False, 0), (False, 1)):
        xs = floor.vector(x0)
        floor.graph(cooperative, xs, w, d, rows, phases, release_first).launch(floor.stream)
        floor.stream.synchronize()
        out = xs[(phases % 2) * d:(phases % 2 + 1) * d].get()
        bad = np.abs(out - ref) > 1e-4 + 1e-4 * np.abs(ref)
        if bad.any():
            kind = 'cooperative' if cooperative else f'kernels (release_first {release_first})'
            raise AssertionError(f'{kind} d={d} rows={rows}: {int(bad.sum())} values off')
    if rows == 0:   # the split-K hand-off: the same chain, each vector a sum over blocks
        xs = floor.cp.concatenate([floor.cp.asarray(x0), floor.cp.zeros(2 * d, np.float32)])
        floor.splitk_graph(xs, d, phases).launch(floor.stream)
        floor.stream.synchronize()
        out = xs[(phases % 3) * d:(phases % 3 + 1) * d].get()
        bad = np.abs(out - ref) > 1e-4 + 1e-4 * np.abs(ref)
        if bad.any():
            raise AssertionError(f'split-K d={d}: {int(bad.sum())} values off')


def bandwidth_table(floor, shapes, repeats):
    cp = floor.cp
    n4 = (1 << 30) // 16
    data = cp.ones(n4 * 4, np.float32)
    rows = []
    for g in sorted({1, 2, 4, 8, 16, 32, 66, floor.n_sm}):
        n = n4 // (8 * g * 1024) * (8 * g * 1024)
        out = cp.zeros(g, np.float32)

        args = (data, np.int64(n), out)
        with floor.stream:
            floor.stream.begin_capture()
            floor.k.read_sum_wide((g,), (1024,), args, stream=floor.stream)
            graph = floor.stream.end_capture()
        us = floor.time_us(graph, max(3, repeats // 4), batch=2)
        floor.stream.synchronize()
        total = float(out.get().astype(np.float64).sum())
        assert total == 4.0 * n, f'read_sum_wide summed {total}, not {4.0 * n}'
        bw = n * 16 / (us * 1e-6)
        rows.append([g, f'{bw / 1e12:.2f}', f'{bw / g / 1e9:.0f}']
                    + [f'{model_bytes(shape_config(s)) / bw * 1e6:.0f}' for s in shapes])
    del data
    header = ['SMs reading', 'TB/s', 'GB/s an SM'] + [f'{s} weights us' for s in shapes]
    return header, rows


def skeleton_table(floor, shapes, phase_counts, repeats, rng):
    header = ['shape', 'phases a layer', 'work', 'rows a block', 'cooperative step us',
              'us a phase', 'kernels step us', 'us a kernel', 'kernels released first step us',
              'us a kernel (released first)', 'split-K kernels step us',
              'us a split-K kernel', 'target us']
    targets = {'smollm2-135m': 150, 'qwen2.5-0.5b': 350, 'llama-3.2-1b': 700}
    rows = []
    for shape in shapes:
        config = shape_config(shape)
        d, layers = config.hidden_size, config.num_layers
        own = floor.own(d)
        own += own % 2
        w, _, x0 = floor.buffers(d, rng)
        for p in phase_counts:
            phases = layers * p + 1
            share = math.ceil(layer_bytes(config) / floor.n_sm / p / (2 * d))
            fits = (SMEM_CAP - 4 * d) // (2 * d)
            capped = max(own, min(share + share % 2, fits - fits % 2))
            for work, r in (('none', 0), ('share', capped)):
                xs = floor.vector(x0)
                t_full, t_zero, t_chain, t_one, t_early, t_early_one = (
                    floor.time_us(floor.graph(coop, xs, w, d, r, n, early), repeats)
                    for coop, n, early in ((True, phases, 0), (True, 0, 0), (False, phases, 0),
                                           (False, 1, 0), (False, phases, 1), (False, 1, 1)))
                splitk = ['-', '-']
                if r == 0:
                    xs3 = floor.cp.zeros(3 * d, np.float32)
                    t_sk, t_sk_one = (floor.time_us(floor.splitk_graph(xs3, d, n), repeats)
                                      for n in (phases, 1))
                    splitk = [f'{t_sk:.1f}', f'{(t_sk - t_sk_one) / (phases - 1):.2f}']
                label = work if work == 'none' else (
                    'share' if r >= share else f'share, capped ({r} of {share} rows)')
                rows.append([shape, p, label, r, f'{t_full:.1f}',
                             f'{(t_full - t_zero) / phases:.2f}', f'{t_chain:.1f}',
                             f'{(t_chain - t_one) / (phases - 1):.2f}', f'{t_early:.1f}',
                             f'{(t_early - t_early_one) / (phases - 1):.2f}', *splitk,
                             targets.get(shape, '-')])
    return header, rows


def cluster_table(floor, repeats, rng, d=576, rounds=90):
    """Return a phase kept inside a thread-block cluster, every cluster of the grid at once.

    Us a round, by cluster size, for each exchange (cluster_floor_probe: pull, cluster_push_probe:
    push); each checked against numpy first.
    """
    from cupy_backends.cuda.api import driver
    x0 = rng.standard_normal(d).astype(np.float32)
    rows = []
    for size in (2, 4, 8, 16):
        grid = size * (floor.n_sm // size)
        row = [size, grid]
        for name, smem in (('cluster_floor_probe', 8 * math.ceil(d / size)),
                           ('cluster_push_probe', 8 * d)):
            driver.funcSetAttribute(getattr(floor.k, name).ptr,
                                    NON_PORTABLE_CLUSTER_SIZE_ALLOWED, 1)
            row += cluster_rounds(floor, name, size, grid, smem, x0, repeats, rounds)
        rows.append(row)
    header = ['cluster size', 'blocks', 'pull: us a round', 'pull: 60 rounds us',
              'pull: 90 rounds us', 'push: us a round', 'push: 60 rounds us',
              'push: 90 rounds us']
    return header, rows


def cluster_rounds(floor, name, size, grid, smem, x0, repeats, rounds):
    """Time a cluster kernel in clusters of ``size``.

    [us a round, 60 rounds us, 90 rounds us] of cluster kernel ``name`` (x0, out, d, rounds) in
    clusters of ``size``, or why the device refused the launch.
    """
    cp, d, fn = floor.cp, len(x0), getattr(floor.k, name)
    x0_dev, out = cp.asarray(x0), cp.zeros(d, np.float32)
    launch = cluster_launcher(size)

    def graph(n):
        with floor.stream:
            floor.stream.begin_capture()
            try:
                launch(fn, (grid,), (256,), (x0_dev, out, np.int32(d), np.int32(n)), smem,
                       floor.stream)
            finally:
                captured = floor.stream.end_capture()
            return captured
    try:
        out.fill(np.nan)
        graph(7).launch(floor.stream)
        floor.stream.synchronize()
    except Exception as exc:   # e.g. a cluster size the device cannot place
        return [f'refused: {exc}', '-', '-']
    ref = floor_reference(None, x0, 7)
    if (np.abs(out.get() - ref) > 1e-4 + 1e-4 * np.abs(ref)).any():
        raise AssertionError(f'{name}, clusters of {size}: values off')
    t_full, t_zero = (floor.time_us(graph(n), repeats) for n in (rounds, 0))
    per = (t_full - t_zero) / rounds
    return [f'{per:.2f}', f'{30 * 2 * per:.1f}', f'{30 * 3 * per:.1f}']


def main():
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--shapes', default='smollm2-135m,qwen2.5-0.5b,llama-3.2-1b')
    parser.add_argument('--phases', default='2,3,5', help='phases a layer to time (P)')
    parser.add_argument('--repeats', type=int, default=20)
    parser.add_argument('--write', action='store_true', help='write the docs/history.md section')
    parser.add_argument('--cluster-only', action='store_true',
                        help='only the cluster table (printed; --write needs every table)')
    args = parser.parse_args()
    from rt_llm_node.model.synthetic import SHAPES
    shapes = [s for s in args.shapes.split(',') if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        parser.error(f'unknown shape(s) {", ".join(unknown)}; known: {", ".join(SHAPES)}')
    try:
        phase_counts = [int(p) for p in args.phases.split(',') if p]
    except ValueError:
        parser.error(f'--phases takes whole numbers separated by commas, got {args.phases!r}')
    if not phase_counts or min(phase_counts) < 1:
        parser.error(f'--phases: every count must be 1 or more, got {args.phases!r}')
    if args.cluster_only and args.write:
        parser.error('--write needs every table; leave out --cluster-only')
    from rt_llm_node.backends import cuda_available
    if not cuda_available():
        print('probe_layer_floor: no CUDA device (CuPy sees none)', file=sys.stderr)
        return 2
    floor = Floor()
    rng = np.random.default_rng(0)
    if args.cluster_only:
        print_table(*cluster_table(floor, args.repeats, rng))
        return 0
    for d in (576, 896, 2048):
        for rows in (0, floor.own(d) + floor.own(d) % 2, 40):
            check(floor, d, rows, 7, rng)
    print(f'{floor.n_sm} SMs; both kinds match numpy (7 phases, d 576/896/2048)')
    bw_header, bw_rows = bandwidth_table(floor, shapes, args.repeats)
    print_table(bw_header, bw_rows)
    sk_header, sk_rows = skeleton_table(floor, shapes, phase_counts, args.repeats, rng)
    print_table(sk_header, sk_rows)
    cl_header, cl_rows = cluster_table(floor, args.repeats, rng)
    print_table(cl_header, cl_rows)
    if args.write:
        import cupy as cp
        name = cp.cuda.runtime.getDeviceProperties(0)['name'].decode()
        body = ('Read bandwidth by the SMs that read (read_sum_wide, a 1024-thread block an SM, '
                "eight 16-byte loads in flight a thread), and the time to read each shape's "
                'weights once at that rate:\n\n' + markdown_table(bw_header, bw_rows)
                + '\n\nThe phase skeleton of a decode step (layers x P + 1 phases; each waits '
                'for the whole activation vector, reads it through L2, takes its RMS and writes '
                "the block's share of the next one; `share`: every block also multiplies its "
                "share of the layer's weights from shared memory, copied in once at the start "
                '(cooperative) or by each launch before its wait (kernels); median us of a '
                'graph replay of one cooperative launch or of one PDL launch a phase; outputs '
                'checked against numpy; only the `none` rows are floors; split-K: each block '
                'adds a partial of the whole next vector with red.global.add instead of '
                'writing its own rows, as a fused SwiGLU + down or o_proj split by head '
                'would):\n\n'
                + markdown_table(sk_header, sk_rows)
                + '\n\nThe same phase (d = 576, no weights) kept inside a thread-block '
                'cluster, a cluster barrier a round, every cluster of the grid at once; pull '
                "(cluster_floor_probe): each block reads the whole vector from its cluster's "
                'shared memories (DSMEM); push (cluster_push_probe): each block keeps the '
                "whole vector and writes its slice into every block's copy; both checked "
                'against numpy:\n\n'
                + markdown_table(cl_header, cl_rows))
        write_section('floor', 'Decode step floor: phase skeleton and few-SM bandwidth', body,
                      machine=f'{name} ({floor.n_sm} SMs), Python {sys.version.split()[0]}',
                      command='PYTHONPATH=. python3 dev/cuda/probe_layer_floor.py --write')


if __name__ == '__main__':
    sys.exit(main())
