"""Full ticks on the GPU with speculative action decoding off and on, side by side.

    PYTHONPATH=. python3 benchmarks/bench_cuda_speculative.py [--shapes smollm2-135m,...]
        [--ticks 10000] [--alternating-ticks 2000] [--tokens 5] [--write]

Per model shape (random bf16 weights), in one run: the full tick of ``bench_cuda.py``
(prefill of 48 tokens at 200 cached, then 6 greedy action tokens among 24 allowed ids, host
included, wall clock) on the backend the node builds without speculation (decode_step
'auto') and on the one it builds with ``speculative_tokens`` = --tokens (verify passes of up
to --tokens + 1 rows; decode step 'kernels', unstaged), the latter with the drafts verified
after the prefill and with them verified beside it (the engine's fused pass), each with
every draft right (the same observation every tick, so the last action is the next one),
the fused one also with the observations alternating (a draft is right only where the two
actions agree). Also the GPU time of a decode step, of a verify pass of --tokens + 1 rows,
of the 48-token prefill and of that prefill with the verify beside it, at 200 cached (CUDA
events, median).
"""

import argparse
import gc
import shlex
import sys
import tempfile

import numpy as np

from bench_cuda import ACTION_TOKENS
from bench_cuda import full_ticks
from bench_cuda import gpu_machine
from bench_cuda import PREFILL
from bench_cuda import SHAPES
from bench_cuda import time_graph
from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint

BASE = 200


def gpu_times(backend, vocab, rows, repeats=200):
    """Median GPU times at BASE cached.

    Us of a decode step and of a verify pass of ``rows``, ms of a 48-token prefill and of one
    with ``rows`` drafts verified beside it (None: the backend has no verify).
    """
    rng = np.random.default_rng(2)
    backend.rollback(0)
    backend.prefill(rng.integers(0, vocab, BASE))
    ids, feed = rng.integers(0, vocab, PREFILL), rng.integers(0, vocab, rows)
    decode = time_graph(backend, BASE, repeats, lambda: backend.decode(7))
    prefill = time_graph(backend, BASE, repeats, lambda: backend.prefill(ids))
    if not backend.verify_tokens:
        return np.median(decode) * 1e3, None, np.median(prefill), None
    verify = time_graph(backend, BASE, repeats, lambda: backend.verify(feed, [None] * rows))
    fused = time_graph(backend, BASE, repeats,
                       lambda: backend.prefill_verify(ids, feed, [None] * (rows + 1)))
    return (np.median(decode) * 1e3, np.median(verify) * 1e3, np.median(prefill),
            np.median(fused))


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_cuda_speculative.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--shapes', default=','.join(SHAPES))
    parser.add_argument('--ticks', type=int, default=10000)
    parser.add_argument('--alternating-ticks', type=int, default=2000,
                        help='ticks of the run with alternating observations')
    parser.add_argument('--tokens', type=int, default=ACTION_TOKENS - 1,
                        help='speculative_tokens (drafts a verify pass)')
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    from rt_llm_node.backends import cuda_available
    if not cuda_available():
        print('bench_cuda_speculative.py: no CUDA device (CuPy sees none)', file=sys.stderr)
        return 2
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    header = ['shape', 'speculation', 'ticks', 'decode step', 'drafts', 'passes an action',
              'drafts kept', 'tick p50 ms', 'p99 ms', 'p99.9 ms', 'max ms',
              'decode step us (GPU)', f'verify of {args.tokens + 1} us (GPU)',
              f'prefill {PREFILL} ms (GPU)',
              f'prefill {PREFILL} + verify of {args.tokens + 1} beside it ms (GPU)',
              'prefill / decode step']
    rows = []
    capacity = 512
    for shape in [s for s in args.shapes.split(',') if s]:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape, seed=0))
        vocab = checkpoint.config.vocab_size
        on = CudaOptions(verify_tokens=args.tokens + 1)
        runs = [('off', CudaOptions(decode_step='auto'), 0, 1, '-', args.ticks, False),
                ('on, after the prefill', on, args.tokens, 1, 'right', args.ticks, False),
                ('on, beside the prefill', None, args.tokens, 1, 'right', args.ticks, True),
                ('on, beside the prefill', None, args.tokens, 2, 'alternating',
                 args.alternating_ticks, True)]
        backend = None
        for label, options, tokens, observations, drafts, ticks, fused in runs:
            if options is not None:
                del backend
                gc.collect()
                backend = CudaBackend(checkpoint, capacity, options)
                decode_us, verify_us, prefill_ms, fused_ms = gpu_times(backend, vocab,
                                                                       args.tokens + 1)
            ms, stats = full_ticks(backend, vocab, ticks, base=BASE, speculative=tokens,
                                   observations=observations, fused=fused)
            pct = np.percentile(ms, [50, 99, 99.9])
            step = backend.decode_step + ('' if backend.staged_decode else ', unstaged')
            row = [shape, label, len(ms), step,
                   drafts, f"{stats['passes']:.2f}",
                   (f"{stats['kept'] / stats['drafted']:.2f}" if stats['drafted'] else '-'),
                   f'{pct[0]:.3f}', f'{pct[1]:.3f}', f'{pct[2]:.3f}', f'{ms.max():.3f}',
                   f'{decode_us:.0f}', '-' if verify_us is None else f'{verify_us:.0f}',
                   f'{prefill_ms:.2f}', '-' if fused_ms is None else f'{fused_ms:.2f}',
                   f'{prefill_ms * 1e3 / decode_us:.1f}']
            rows.append(row)
            print_table(header, [row])
        del backend
        gc.collect()
    print()
    print_table(header, rows)
    for shape in dict.fromkeys(row[0] for row in rows):   # a section a shape, run alone or not
        body = (f'Full ticks (prefill of {PREFILL} tokens at {BASE} cached, '
                f'then {ACTION_TOKENS} greedy action tokens among 24 allowed ids, each run, the '
                'attention mass read after every call; host included, wall clock). Off: the '
                "backend the node builds without speculation (decode_step 'auto'). On: "
                f'speculative_tokens {args.tokens}, the drafts verified after the prefill: '
                'after the first token the last action from there on (where it began the same '
                'way) is verified in one pass; beside the prefill (what the engine does): the '
                f'last action, up to {args.tokens + 1} tokens of it, is verified in a pass that '
                'runs beside the prefill (prefill_verify), and the action goes on from what it '
                'kept. Either way the drafts greedy decoding would have chosen are kept, the '
                'rest rolled back. Drafts right: the same observation every tick; alternating: '
                'two observations in turn. Passes an action: decode steps and verify passes '
                'after the prefill (a pass beside it not counted). GPU columns: CUDA events, '
                f'median, at {BASE} cached.\n\n'
                + markdown_table(header, [row for row in rows if row[0] == shape]))
        if args.write:
            machine = gpu_machine()
            write_section(f'speculative_cuda_{shape}',
                          f'Speculative action decoding on the GPU: {shape} (full ticks)',
                          body, machine=machine,
                          command=' '.join(['PYTHONPATH=. python3 '
                                            'benchmarks/bench_cuda_speculative.py']
                                           + [shlex.quote(a) for a in sys.argv[1:]]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
