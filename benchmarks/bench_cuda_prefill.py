"""The CUDA prefill at a tick's sizes against a decode step (it reads the same weights once).

    PYTHONPATH=. python3 benchmarks/bench_cuda_prefill.py [--shapes smollm2-135m,...]
        [--tokens 16,32,48,64] [--cached 0,256,512,1024] [--repeats 100] [--write]

Per model shape (random bf16 weights), on the backend the node builds without speculation
(decode_step 'auto'): the GPU time of a prefill of each --tokens count after each --cached
count of tokens, and of one decode step after those cached tokens plus the prefill's (CUDA
events, median over --repeats); each prefill as a multiple of that decode step.
"""

import argparse
from functools import partial
import gc
import shlex
import sys
import tempfile

import numpy as np

from bench_cuda import gpu_machine
from bench_cuda import SHAPES
from bench_cuda import time_graph
from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def counts(text):
    return [int(v) for v in text.split(',') if v]


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_cuda_prefill.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--shapes', default=','.join(SHAPES))
    parser.add_argument('--tokens', type=counts, default=[16, 32, 48, 64],
                        help='prefill sizes, comma-separated')
    parser.add_argument('--cached', type=counts, default=[0, 256, 512, 1024],
                        help='tokens in the cache before each prefill, comma-separated')
    parser.add_argument('--repeats', type=int, default=100)
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    if not args.tokens or not args.cached or min(args.tokens) < 1 or min(args.cached) < 0:
        parser.error('--tokens needs counts >= 1 and --cached counts >= 0')
    args.tokens = sorted(set(args.tokens))
    from rt_llm_node.backends import cuda_available
    if not cuda_available():
        print('bench_cuda_prefill.py: no CUDA device (CuPy sees none)', file=sys.stderr)
        return 2
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    capacity = max(args.cached) + args.tokens[-1] + 1
    header = (['shape', 'decode step', 'cached', 'decode step us (GPU)']
              + [f'prefill {n} ms (GPU)' for n in args.tokens]
              + [f'prefill {n} / step' for n in args.tokens])
    rows = []
    for shape in [s for s in args.shapes.split(',') if s]:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape, seed=0))
        vocab = checkpoint.config.vocab_size
        backend = CudaBackend(checkpoint, capacity, CudaOptions(decode_step='auto'))
        rng = np.random.default_rng(3)
        for cached in args.cached:
            backend.rollback(0)   # the cached tokens, and as many as the largest prefill
            backend.prefill(rng.integers(0, vocab, cached + args.tokens[-1]))
            prefill_ms, ratios = [], []
            for n in args.tokens:
                ids = rng.integers(0, vocab, n)
                ms = float(np.median(time_graph(backend, cached, args.repeats,
                                                partial(backend.prefill, ids))))
                step_us = float(np.median(time_graph(backend, cached + n, args.repeats,
                                                     partial(backend.decode, 7)))) * 1e3
                prefill_ms.append(f'{ms:.3f}')
                ratios.append(f'{ms * 1e3 / step_us:.1f}')
            # the step column: after the cached tokens and the largest prefill
            row = ([shape, backend.decode_step, cached, f'{step_us:.0f}']
                   + prefill_ms + ratios)
            rows.append(row)
            print_table(header, [row])
        del backend
        gc.collect()
    print()
    print_table(header, rows)
    body = ('A prefill of each size after each cached count, on the backend the node builds '
            "without speculation (decode_step 'auto'), random bf16 weights; GPU time of the "
            'graph replays (CUDA events, median). The decode step is timed after the cached '
            'tokens plus that prefill (the column: plus the largest); the ratios divide each '
            'prefill by the step after it.\n\n' + markdown_table(header, rows))
    if args.write:
        write_section('cuda_prefill_sizes', "CUDA prefill at a tick's sizes against a decode step",
                      body, machine=gpu_machine(),
                      command=' '.join(['PYTHONPATH=. python3 benchmarks/bench_cuda_prefill.py']
                                       + [shlex.quote(a) for a in sys.argv[1:]]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
