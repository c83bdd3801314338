"""Decode-step variants of the CUDA backend side by side, one process, same weights.

    PYTHONPATH=. python3 tools/compare_decode.py [--shapes smollm2-135m,...] [--repeats 200]

Per shape (random bf16 weights, seed 0): GPU time of one decode-graph replay (CUDA events,
median and p99) at 256 and 1024 cached tokens for: the default forward (five kernels a
layer), decode_persistent (persistent_decode='barrier'), decode_ring with its flag barrier
and with the shared-counter barrier; and whether each variant's greedy token after the
timed steps equals the default's. Prints a table (no BENCHMARKS.md section: rt-llm-bench
writes the benchmark's table).
"""

import argparse
from pathlib import Path
import sys
import tempfile

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rt_llm_node.bench import SHAPES, time_decode_replay  # noqa: E402
from rt_llm_node.bench_report import print_table  # noqa: E402
from rt_llm_node.model import load_checkpoint  # noqa: E402
from rt_llm_node.model.synthetic import write_random_checkpoint  # noqa: E402

VARIANTS = (('kernels', False, True), ('barrier', 'barrier', True),
            ('ring, flags', 'ring', True), ('ring, counter', 'ring', False))


PROFILE = ('barriers', 'staging', 'chunk waits', 'computing', 'attention', 'rest')


def profile(backend, ctx, steps=50):
    import cupy as cp
    backend.ring_profile = cp.zeros((backend.n_sm, 8), np.int64)
    backend.set_persistent_decode('ring')
    backend.rollback(0)
    backend.prefill(np.random.default_rng(0).integers(0, backend.config.vocab_size, ctx))
    backend.ring_profile.fill(0)
    time_decode_replay(backend, ctx, steps)
    khz = cp.cuda.runtime.deviceGetAttribute(13, backend.device.id)   # cudaDevAttrClockRate
    us = backend.ring_profile.get()[:, :len(PROFILE)] / steps / khz * 1e3
    print('  thread 0 a step, us (mean over blocks, min-max): ' + ', '.join(
        f'{name} {us[:, i].mean():.1f} ({us[:, i].min():.1f}-{us[:, i].max():.1f})'
        for i, name in enumerate(PROFILE)) + f'; sum {us.sum(1).mean():.1f}')
    backend.ring_profile = None
    backend.set_persistent_decode('ring')


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
    parser.add_argument('--shapes', default=','.join(SHAPES))
    parser.add_argument('--repeats', type=int, default=200)
    parser.add_argument('--contexts', default='256,1024')
    parser.add_argument('--profile', action='store_true',
                        help="also decode_ring's clock64 accounting of a step (thread 0 of "
                             'each block, mean over blocks)')
    args = parser.parse_args(argv)
    from rt_llm_node.backends.cuda_backend import CudaBackend
    contexts = [int(c) for c in args.contexts.split(',')]
    header = ['shape', 'variant'] + [f'us @{c} (p99)' for c in contexts] + ['token = default']
    rows = []
    for shape in [s for s in args.shapes.split(',') if s]:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape, seed=0))
        vocab = checkpoint.config.vocab_size
        backend = CudaBackend(checkpoint, max(contexts) + 64)
        prompt = np.random.default_rng(0).integers(0, vocab, max(contexts))
        reference = None
        for label, kind, flags in VARIANTS:
            backend.flag_barrier = flags
            problem = backend.persistent_decode_problem(kind) if kind else None
            if problem:
                rows.append([shape, label] + ['-'] * len(contexts) + [problem])
                continue
            backend.set_persistent_decode(kind)   # recaptures, clears the cache
            cells = []
            for ctx in contexts:
                backend.rollback(0)
                backend.prefill(prompt[:ctx])
                ms = time_decode_replay(backend, ctx, args.repeats)[10:]
                cells.append(f'{np.median(ms) * 1e3:.1f} ({np.percentile(ms, 99) * 1e3:.1f})')
            backend.rollback(contexts[-1])
            backend.decode(11)
            token = backend.argmax()
            reference = token if reference is None else reference
            rows.append([shape, label] + cells + [str(token == reference)])
            print_table(header, rows[-1:])
            if args.profile and kind == 'ring':
                profile(backend, contexts[0])
        del backend
    print()
    print_table(header, rows)


if __name__ == '__main__':
    main()
