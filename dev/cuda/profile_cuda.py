"""Where a CUDA decode step spends its time: per kernel (CUDA events), graph replay, host calls.

    PYTHONPATH=. python3 dev/cuda/profile_cuda.py [--shape smollm2-135m] [--context 256]
        [--prefill | --verify N [--verify-x global]] [--format i8/32]

The decode graph's replay as the persistent step (where the shape allows it) and as a kernel
per phase; host calls; then each kernel of the first layer and the LM head timed in a
graph-captured chain of its own kind (``--prefill``: the kernels of a 48-token prefill;
``--verify N``: of a verify pass of N rows; ``--verify-x global``: its matmuls reading x from
global memory, none staging it in shared memory); the 48-token prefill. ``--format``: the
weights in a runtime integer format of benchmarks/bench_quant.py (bf16: as stored).
"""

import argparse
import tempfile
import time

import numpy as np

from devkit import chain_us  # noqa: I100  (puts benchmarks/ on the path)
from devkit import time_decode_replay  # noqa: I100
from bench_quant import FORMATS  # noqa: I100,I201
from bench_quant import to_format  # noqa: I100

from rt_llm_node.backends import cuda_backend
from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.backends.cuda_backend import CudaOptions
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shape', default='smollm2-135m')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--repeats', type=int, default=50)
    parser.add_argument('--prefill', action='store_true', help='profile a 48-token prefill')
    parser.add_argument('--verify', type=int, default=0, help='profile a verify pass of N rows')
    parser.add_argument('--verify-x', choices=('staged', 'global'), default='staged',
                        help="'global': no verify matmul stages its xhat in shared memory")
    parser.add_argument('--chain', type=int, default=32, help='launches per kernel graph')
    parser.add_argument('--format', default='bf16', choices=sorted(FORMATS))
    args = parser.parse_args()
    import cupy as cp
    if args.verify_x == 'global':
        cuda_backend.TV_MAX_SHARED = 0
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, args.shape))
    checkpoint = to_format(checkpoint, FORMATS[args.format][1])
    if CudaBackend(checkpoint, 64, CudaOptions('kernels')).persistent_decode_problem() is None:
        persistent = CudaBackend(checkpoint, 1088, CudaOptions('persistent'))
        persistent.prefill(np.random.default_rng(0).integers(0, checkpoint.config.vocab_size,
                                                             args.context))
        replay = time_decode_replay(persistent, args.context, args.repeats)
        print(f'  gpu: decode graph replay, persistent {np.median(replay) * 1e3:.1f} us')
        del persistent
    backend = CudaBackend(checkpoint, 1088, CudaOptions('kernels', verify_tokens=args.verify))
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

    def replay_us():
        return np.median(time_decode_replay(backend, args.context, args.repeats)) * 1e3
    print(f'  gpu: decode graph replay, a kernel per phase {replay_us():.1f} us '
          f'(staged: {backend.staged_decode})')
    print('  resident blocks an SM: '
          + ', '.join(f'{k[0]}: {v}' for k, v in sorted(backend._resident.items())))
    # per kernel: each launch of the forward's first layer (and the LM head) captured
    # `--chain` times back to back in one graph, launched as in the forward (dependent
    # where the backend uses it), so a row is the kernel's time in a chain of its own kind
    recorded = []
    launch = backend._launch

    def record(name, grid, block, *a, **kw):
        recorded.append((name, grid, block, a, kw))
    backend._launch = record
    n_max, n = (64, 48) if args.prefill else (args.verify, args.verify) if args.verify else (1, 1)
    backend._enqueue_forward(n_max, verify=bool(args.verify))
    backend._launch = launch
    # the embedding, the layers, then the tail: the mass (one token), the LM head and
    # (verify) the rows' arg-maxes
    tail = 1 + (n_max == 1 or args.verify > 0) + (args.verify > 0)
    per_layer = (len(recorded) - 1 - tail) // checkpoint.config.num_layers
    picked = recorded[1:1 + per_layer] + recorded[len(recorded) - tail:]
    total_us = 0.0
    for i, (name, grid, block, a, kw) in enumerate(picked):
        backend.rollback(args.context)
        backend._write_state(7, args.context, n, 0)
        us = chain_us(backend, launch, name, grid, block, a, kw, args.chain)
        count = 1 if i >= per_layer else checkpoint.config.num_layers   # the tail once
        total_us += us * count
        line = f'  kernel {name:22s} grid {str(tuple(grid)):12s} {us:8.2f} us'
        mbytes = None
        if name.startswith('matmul'):
            mbytes = a[1].nbytes / 1e6   # the weight matrix, in its stored dtype
        elif name.startswith('qmatvec'):   # codes, scales and offsets
            mbytes = sum(getattr(w, 'nbytes', 0) for w in a[1:4]) / 1e6
            line += f' block {block[0]} split {int(a[-1])}'
        if mbytes is not None:
            line += f'  weights {mbytes:7.2f} MB  {mbytes / us:6.2f} TB/s'
        print(line + f'  x{count}')
    print(f'  sum over the forward {total_us:.1f} us (each kernel timed in a chain of its own)')
    ids = np.random.default_rng(1).integers(0, vocab, 48)

    def prefill_ms():
        pre = []
        for _ in range(20):
            backend.rollback(args.context)
            stream.synchronize()
            start.record(stream)
            backend.prefill(ids)
            stop.record(stream)
            stop.synchronize()
            pre.append(cp.cuda.get_elapsed_time(start, stop))
        return np.median(pre), backend.logits()
    print(f'  prefill 48: {prefill_ms()[0]:.3f} ms')


if __name__ == '__main__':
    main()
