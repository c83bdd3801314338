"""Where a CUDA decode step spends its time: per kernel (CUDA events), graph replay, host calls.

    PYTHONPATH=. python3 tools/profile_cuda.py [--shape smollm2-135m] [--context 256]
"""

import argparse
from collections import defaultdict
import tempfile
import time

import numpy as np

from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shape', default='smollm2-135m')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--repeats', type=int, default=50)
    parser.add_argument('--prefill', action='store_true', help='profile a 48-token prefill')
    args = parser.parse_args()
    import cupy as cp
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, args.shape))
    backend = CudaBackend(checkpoint, 1088)
    vocab = checkpoint.config.vocab_size
    backend.prefill(np.random.default_rng(0).integers(0, vocab, args.context))
    backend.attention_mass()
    stream = backend.stream

    def host_ms(fn, n=args.repeats):
        out = []
        for _ in range(n):
            backend.rollback(args.context)
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        stream.synchronize()
        return np.median(out)

    print(f'{args.shape} at {args.context} cached tokens')
    calls = {
        'write_state': lambda: backend._write_state(1, args.context, 1, 0),
        'decode()+sync': lambda: (backend.decode(7), stream.synchronize()),
        'decode()+argmax': lambda: (backend.decode(7), backend.argmax()),
        'decode()+mass+argmax(20 ids)': lambda: (backend.decode(7), backend.attention_mass(),
                                                 backend.argmax(np.arange(20))),
    }
    for name, call in calls.items():
        print(f'  host: {name} {host_ms(call):.4f} ms')
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    graph_ms = []
    for _ in range(args.repeats):
        backend.rollback(args.context)
        backend._write_state(7, args.context, 1, 0)
        stream.synchronize()
        start.record(stream)
        backend.graphs[1].launch(stream)
        stop.record(stream)
        stop.synchronize()
        graph_ms.append(cp.cuda.get_elapsed_time(start, stop))
    print(f'  gpu: decode graph replay {np.median(graph_ms) * 1e3:.1f} us')
    # per kernel, launched one by one with events around each
    per = defaultdict(list)
    launch = backend._launch

    def timed(name, grid, block, *a, **kw):
        s, e = cp.cuda.Event(), cp.cuda.Event()
        s.record(stream)
        launch(name, grid, block, *a, **kw)
        e.record(stream)
        per[name].append((s, e))
    backend._launch = timed
    n_max, n = (64, 48) if args.prefill else (1, 1)
    for _ in range(5):
        backend.rollback(args.context)
        backend._write_state(7, args.context, n, 0)
        backend._enqueue_forward(n_max)
    stream.synchronize()
    backend._launch = launch
    total = 0.0
    rows = []
    for name, evs in per.items():
        t = [cp.cuda.get_elapsed_time(s, e) * 1e3 for s, e in evs]
        per_forward = sum(t) / 5
        total += per_forward
        rows.append((per_forward, name, len(evs) // 5, np.median(t)))
    for per_forward, name, count, med in sorted(rows, reverse=True):
        print(f'  kernel {name:22s} x{count:3d}  median {med:8.2f} us  '
              f'per step {per_forward:9.1f} us')
    print(f'  sum of kernels {total:.1f} us per step (launched one by one)')
    ids = np.random.default_rng(1).integers(0, vocab, 48)
    pre = []
    for _ in range(20):
        backend.rollback(args.context)
        stream.synchronize()
        start.record(stream)
        backend.prefill(ids)
        stop.record(stream)
        stop.synchronize()
        pre.append(cp.cuda.get_elapsed_time(start, stop))
    print(f'  prefill 48: {np.median(pre):.3f} ms')


if __name__ == '__main__':
    main()
