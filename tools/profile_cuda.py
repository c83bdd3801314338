"""Where a CUDA decode step spends its time: per kernel (CUDA events), graph replay, host calls.

    PYTHONPATH=. python3 tools/profile_cuda.py [--shape smollm2-135m] [--context 256]
        [--att-prefill-blocks 100000,2048]

--att-prefill-blocks: the 48-token prefill (GPU time, median of 20) with attn_partial's grid
capped at each block count (CudaBackend.att_prefill_blocks; 100000: a block for every
split of the capacity, as before stop 33), side by side, each prefill's logits checked
equal to the first's.
"""

import argparse
import tempfile
import time

import numpy as np

from rt_llm_node.backends.cuda_backend import CudaBackend
from rt_llm_node.bench import time_decode_replay
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument('--shape', default='smollm2-135m')
    parser.add_argument('--context', type=int, default=256)
    parser.add_argument('--repeats', type=int, default=50)
    parser.add_argument('--prefill', action='store_true', help='profile a 48-token prefill')
    parser.add_argument('--prefill-mma', action='store_true',
                        help="the prefill's matmuls on tensor cores (the *_mma kernels)")
    parser.add_argument('--chain', type=int, default=32, help='launches per kernel graph')
    parser.add_argument('--att-prefill-blocks', type=lambda v: [int(k) for k in v.split(',') if k],
                        default=[], help="attn_partial's block caps to compare (N,N,..)")
    parser.add_argument('--sweep-blocks', type=lambda v: [int(k) for k in v.split(',') if k],
                        default=[], help='also time grid_stride caps of K blocks an SM (K,K,..)')
    args = parser.parse_args()
    import cupy as cp
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = load_checkpoint(write_random_checkpoint(tmp, args.shape))
    backend = CudaBackend(checkpoint, 1088, persistent_decode=None,
                          prefill_mma=args.prefill_mma)
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
    if backend.persistent_decode:
        print(f'  gpu: decode graph replay, persistent {replay_us():.1f} us')
        backend.set_persistent_decode(False)   # the kernels below are the per-phase ones
        backend.prefill(np.random.default_rng(0).integers(0, vocab, args.context))
    print(f'  gpu: decode graph replay, a kernel per phase {replay_us():.1f} us')
    # side by side: the one-token matmuls' grid layouts (block caps of k blocks an SM)
    for layout in [False] + [k * backend.n_sm for k in args.sweep_blocks] + [True]:
        backend.set_grid_stride(layout)
        backend.prefill(np.random.default_rng(0).integers(0, vocab, args.context))
        print(f'  gpu: decode graph replay, grid_stride={layout} {replay_us():.1f} us')
    if backend.dependent_launch:   # side by side: the staged one-token matmuls
        backend.set_staged_decode(True)
        backend.prefill(np.random.default_rng(0).integers(0, vocab, args.context))
        print(f'  gpu: decode graph replay, staged_decode=True {replay_us():.1f} us '
              f'(staged: {backend.staged_matmuls()})')
        backend.set_staged_decode(False)
        backend.prefill(np.random.default_rng(0).integers(0, vocab, args.context))
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
    n_max, n = (64, 48) if args.prefill else (1, 1)
    backend._enqueue_forward(n_max)
    backend._launch = launch
    per_layer = (len(recorded) - (3 if n_max == 1 else 2)) // checkpoint.config.num_layers
    picked = recorded[1:1 + per_layer] + recorded[-1:]   # first layer, then the LM head
    total_us = 0.0
    for name, grid, block, a, kw in picked:
        backend.rollback(args.context)
        backend._write_state(7, args.context, n, 0)
        with stream:
            stream.begin_capture()
            for _ in range(args.chain):
                launch(name, grid, block, *a, **kw)
            graph = stream.end_capture()
        graph.upload(stream)
        times = []
        for _ in range(10):
            start.record(stream)
            graph.launch(stream)
            stop.record(stream)
            stop.synchronize()
            times.append(cp.cuda.get_elapsed_time(start, stop) * 1e3 / args.chain)
        us = float(np.median(times))
        count = checkpoint.config.num_layers if name not in ('matmul_store_t1',) else 1
        total_us += us * count
        line = f'  kernel {name:22s} grid {str(tuple(grid)):12s} {us:8.2f} us'
        if name.startswith('matmul'):
            mbytes = a[1].nbytes / 1e6   # the weight matrix, in its stored dtype
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
    print(f'  prefill 48: {prefill_ms()[0]:.3f} ms (att_prefill_blocks '
          f'{backend.att_prefill_blocks})')
    first = None
    for blocks in args.att_prefill_blocks:
        backend.att_prefill_blocks = blocks
        with backend.device:
            backend._warm_up_and_capture()
        backend.prefill(np.random.default_rng(0).integers(0, vocab, args.context))
        ms, logits = prefill_ms()
        first = logits if first is None else first
        same = 'equal' if np.array_equal(logits, first) else 'DIFFERENT'
        print(f'  prefill 48, att_prefill_blocks {blocks}: {ms:.3f} ms, logits {same}')


if __name__ == '__main__':
    main()
