"""Verify-pass geometry: a verify of N rows per VERIFY_NT (tokens a block of the _tv matmuls).

    PYTHONPATH=. python3 dev/cuda/sweep_tv.py [--shapes smollm2-135m,...] [--nt 8,6,4,3,2]
        [--rows 6]

Each VERIFY_NT is a build of its own (GEOMETRY is a -D of every build); printed per shape:
the GPU time of a decode step and of a verify pass of --rows rows at 248 cached (CUDA
events, median), and whether every row's logits equal those of a decode step bit for bit.
"""

import argparse
from functools import partial
import gc
import tempfile

import numpy as np

import devkit  # noqa: F401,I100  (puts benchmarks/ on the path)
from bench_cuda import time_graph  # noqa: I100,I201

from rt_llm_node.backends import cuda_backend
from rt_llm_node.backends import cuda_kernels
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint

BASE = 248


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shapes', default='smollm2-135m,qwen2.5-0.5b,llama-3.2-1b')
    parser.add_argument('--nt', default='8,6,4,3,2', help='VERIFY_NT values, comma-separated')
    parser.add_argument('--rows', type=int, default=6)
    parser.add_argument('--repeats', type=int, default=100)
    args = parser.parse_args()
    for shape in args.shapes.split(','):
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape, seed=0))
        vocab = checkpoint.config.vocab_size
        rng = np.random.default_rng(1)
        base, feed = rng.integers(0, vocab, BASE), rng.integers(0, vocab, args.rows)
        print(f'{shape}: verify of {args.rows} at {BASE}, GPU us (median)')
        for nt in [int(v) for v in args.nt.split(',')]:
            cuda_kernels.GEOMETRY['VERIFY_NT'] = nt
            cuda_backend.VERIFY_NT = nt
            backend = cuda_backend.CudaBackend(
                checkpoint, 512, cuda_backend.CudaOptions('kernels', verify_tokens=args.rows))
            backend.prefill(base)
            allowed = [None] * args.rows
            step = np.median(time_graph(backend, BASE, args.repeats,
                                        partial(backend.decode, 7))) * 1e3
            verify = np.median(time_graph(backend, BASE, args.repeats,
                                          partial(backend.verify, feed, allowed))) * 1e3
            rows = [None] * args.rows   # each row's logits after the pass (rolled back into
            backend.rollback(BASE)      # the rows from the last), then after decode steps
            backend.verify(feed, allowed)
            for i in reversed(range(args.rows)):
                backend.rollback(BASE + i + 1)
                rows[i] = backend.logits().copy()
            backend.rollback(BASE)
            same = True
            for i, token in enumerate(feed):
                backend.decode(int(token))
                same = same and np.array_equal(backend.logits(), rows[i])
            print(f'  VERIFY_NT {nt}: decode step {step:6.0f}  verify {verify:6.0f}  '
                  f'rows equal decode steps: {same}', flush=True)
            del backend
            gc.collect()


if __name__ == '__main__':
    main()
