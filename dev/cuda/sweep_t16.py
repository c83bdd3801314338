"""Prefill tile geometry: the 48-token prefill per build of the tile, and per kernel per warps.

    PYTHONPATH=. python3 dev/cuda/sweep_t16.py [--shapes smollm2-135m,...]
        [--configs 8x16x16x2x4,16x16x16] [--kernels]

A config is T16_UNITS x T16_TOKENS x T16_MAX_WARPS [x T16_BATCH [x T16_MIN_CHUNKS]]: row
pairs and tokens a block, most warps a block, chunks of K a warp loads together, chunks each
warp keeps at least (t16_warps). Each is a build of its own (GEOMETRY is a -D of every
build); printed: the prefill of 48 tokens at 200 cached, GPU ms (CUDA events, median), and
the last token's logits against the first config's (largest difference over the largest
logit: the tile changes no product, only where the sums meet). ``--kernels``: also each
matmul of the first layer launched at 4, 8, .. most warps, us (a chain of 20 of one launch).
The figures that chose the shipped geometry are in benchmarks/RESULTS.md ("Prefill tiles").
"""

import argparse
from functools import partial
import gc
import tempfile

import numpy as np

from devkit import chain_us  # noqa: I100  (puts benchmarks/ on the path)
from bench_cuda import time_graph  # noqa: I100,I201

from rt_llm_node.backends import cuda_backend
from rt_llm_node.backends import cuda_kernels
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def configure(units, tokens, warps, batch=1, min_chunks=1):
    cuda_kernels.GEOMETRY.update(T16_UNITS=units, T16_TOKENS=tokens, T16_MAX_WARPS=warps,
                                 T16_BATCH=batch)
    cuda_backend.T16_UNITS, cuda_backend.T16_TOKENS = units, tokens
    cuda_backend.T16_MAX_WARPS, cuda_backend.T16_MIN_CHUNKS = warps, min_chunks


def kernel_warps(backend, most, chain=20):
    """Each matmul of a prefill's first layer at 4 .. ``most`` warps, us (a chain of its own)."""
    recorded, launch = [], backend._launch
    backend._launch = lambda name, grid, block, *a, **kw: recorded.append((name, grid, a, kw))
    backend._enqueue_forward(64)
    backend._launch = launch
    seen = []
    for name, grid, a, kw in recorded:
        if not name.endswith('_t16') or (name, a[3]) in seen:
            continue
        seen.append((name, a[3]))
        if len(seen) > 4:
            break
        row = []
        warps = 4
        while warps <= most:
            backend._write_state(7, 200, 48, 0)
            us = chain_us(backend, launch, name, grid, (32 * warps,), a, kw, chain)
            row.append(f'{warps} warps {us:6.2f}')
            warps *= 2
        print(f'    {name:22s} K {int(a[3]):5d} grid {str(tuple(grid)):10s} ' + '  '.join(row))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shapes', default='smollm2-135m,qwen2.5-0.5b,llama-3.2-1b')
    parser.add_argument('--configs', default='8x16x16x2x4,16x16x16',
                        help='units x tokens x most warps [x T16_BATCH [x T16_MIN_CHUNKS]]')
    parser.add_argument('--repeats', type=int, default=100)
    parser.add_argument('--kernels', action='store_true',
                        help='and each matmul of the first layer at 4 .. most warps')
    args = parser.parse_args()
    configs = [tuple(int(v) for v in c.split('x')) for c in args.configs.split(',')]
    for shape in args.shapes.split(','):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape, seed=0))
        vocab = checkpoint.config.vocab_size
        rng = np.random.default_rng(1)
        base, ids = rng.integers(0, vocab, 200), rng.integers(0, vocab, 48)
        reference = None
        print(f'{shape}: prefill 48 at 200, GPU ms (median)')
        for config in configs:
            configure(*config)
            backend = cuda_backend.CudaBackend(checkpoint, 512,
                                               cuda_backend.CudaOptions('kernels'))
            backend.prefill(base)
            ms = np.median(time_graph(backend, 200, args.repeats, partial(backend.prefill, ids)))
            backend.rollback(200)
            backend.prefill(ids)
            logits = backend.logits().copy()
            if reference is None:
                reference = logits
            err = np.abs(logits - reference).max() / np.abs(reference).max()
            print(f'  {"x".join(map(str, config)):14s} '
                  f'{ms:7.3f} ms   logits vs first {err:.1e}', flush=True)
            if args.kernels:
                kernel_warps(backend, config[2])
            del backend
            gc.collect()


if __name__ == '__main__':
    main()
