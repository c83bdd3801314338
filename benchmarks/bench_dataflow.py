"""The dataflow decode step against today's steps, and at a Jetson Orin's multiprocessor count.

In one run on one GPU, per model shape (random weights, bf16 unless ``--dtype``): the GPU
time of one decode-graph replay at 256 cached tokens (median and p99, CUDA events) as a
kernel a phase ('kernels'), as one cooperative launch with grid barriers ('persistent'), and
as one launch running per-block task lists ('dataflow', ``CudaOptions.dataflow_lists``) with
a list a multiprocessor, then with 16 and 8 lists (AGX Orin and Orin Nano have 16 and 8
multiprocessors; the other multiprocessors stay idle). Before timing, each dataflow backend's
logits and attention mass are checked bit for bit against the persistent step's.

    PYTHONPATH=. python3 benchmarks/bench_dataflow.py [--write] [--shapes smollm2-135m,...]
        [--repeats 300] [--dtype BF16]
"""

import argparse
import gc
import shlex
import sys
import tempfile

import numpy as np

from bench_cuda import gpu_machine
from bench_cuda import measure_ours
from report import markdown_table
from report import print_table
from report import write_section
from rt_llm_node.model import load_checkpoint
from rt_llm_node.model.synthetic import write_random_checkpoint

SHAPES = ('smollm2-135m', 'qwen2.5-0.5b', 'llama-3.2-1b')
CONTEXT = 256


def same_as(reference, backend, vocab):
    """Return whether ``backend`` gives ``reference``'s logits and mass bit for bit."""
    prompt = np.random.default_rng(3).integers(0, vocab, CONTEXT - 8)
    runs = []
    for b in (reference, backend):
        b.rollback(0)
        b.prefill(prompt)
        out = []
        for token in range(8):
            b.decode(token)
            out.append((b.logits(), b.attention_mass()))
        runs.append(out)
    return all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
               for a, b in zip(*runs))


def measure(backend, vocab, repeats):
    """Return 'median (p99)' us of ``backend``'s decode-graph replay at CONTEXT cached."""
    times = measure_ours(backend, vocab, repeats, contexts=(CONTEXT,))
    return f'{times[CONTEXT][0]:.0f} ({times[CONTEXT][1]:.0f})'


def main(argv=None):
    parser = argparse.ArgumentParser(prog='bench_dataflow.py',
                                     description=__doc__.split('\n')[0])
    parser.add_argument('--shapes', default=','.join(SHAPES))
    parser.add_argument('--repeats', type=int, default=300)
    parser.add_argument('--dtype', default='BF16', choices=('BF16', 'F16', 'F32'))
    parser.add_argument('--write', action='store_true',
                        help='write the section into benchmarks/RESULTS.md')
    args = parser.parse_args(argv)
    from rt_llm_node.backends import cuda_available
    if not cuda_available():
        print('bench_dataflow.py: no CUDA device (CuPy sees none)', file=sys.stderr)
        return 2
    import cupy
    from rt_llm_node.backends.cuda_backend import CudaBackend
    from rt_llm_node.backends.cuda_backend import CudaOptions
    n_sm = cupy.cuda.Device().attributes['MultiProcessorCount']
    lists = (n_sm, 16, 8)
    header = ['shape', 'kernels us', 'persistent us',
              *[f'dataflow {n} lists us' for n in lists], 'same bits']
    rows = []
    for shape in [s for s in args.shapes.split(',') if s]:
        with tempfile.TemporaryDirectory() as tmp:
            checkpoint = load_checkpoint(write_random_checkpoint(tmp, shape, seed=0,
                                                                 dtype=args.dtype))
            vocab, capacity = checkpoint.config.vocab_size, CONTEXT + 64
            kernels = CudaBackend(checkpoint, capacity, CudaOptions(decode_step='kernels'))
            cells = [measure(kernels, vocab, args.repeats)]
            del kernels
            # the persistent step: its own column and the bits every dataflow list count must give
            reference = CudaBackend(checkpoint, capacity, CudaOptions(decode_step='persistent'))
            cells.append(measure(reference, vocab, args.repeats))
            same = True
            for n in lists:
                backend = CudaBackend(checkpoint, capacity, CudaOptions(
                    decode_step='persistent', dataflow_lists=n))
                same = same and same_as(reference, backend, vocab)
                cells.append(measure(backend, vocab, args.repeats))
                del backend
                gc.collect()
            del reference
            gc.collect()
        rows.append([shape, *cells, 'yes' if same else 'NO'])
        print_table(header, rows[-1:])
    print()
    print_table(header, rows)
    body = (f'{args.dtype} weights (random), decode-graph replay at {CONTEXT} cached tokens, '
            'GPU time (CUDA events), median (p99) over '
            f'{args.repeats} replays; each column a backend of its own. Dataflow: '
            'decode_dataflow with the given number of task lists (one block each; '
            f'{n_sm} = every multiprocessor, 16 and 8 as on a Jetson AGX Orin and Orin '
            "Nano); same bits: its logits and attention mass equal the persistent step's "
            'over 8 steps.\n\n' + markdown_table(header, rows))
    if args.write:
        write_section('dataflow', 'Dataflow decode step (per-block task lists)', body,
                      machine=gpu_machine(),
                      command=' '.join(['PYTHONPATH=. python3 benchmarks/bench_dataflow.py']
                                       + [shlex.quote(a) for a in sys.argv[1:]]))
    return 0


if __name__ == '__main__':
    sys.exit(main())
